"""Assembly: a run's hardware config -> link, clock, cost model, and offloaded experts.

Owns: the one place where capabilities are decided (virtual, emulated or real clock; CUDA or
CPU), the charged sizes (own or the real model's), the emulated clock's calibration, and
building an `OffloadRuntime` for a model and budget. Systems call `timing_for` and
`offload_model`; nothing else constructs links.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from specter.config import HardwareConfig
from specter.errors import UserError
from specter.models.real_configs import REAL_CONFIGS
from specter.offload.cache import ExpertCache
from specter.offload.costmodel import (ChargedSizes, CostModel, HardwareProfile, charged_sizes,
                                       layer_counts, real_charged_sizes)
from specter.offload.link import Link, LinkProfile, make_link
from specter.offload.policy import policy_named
from specter.offload.prefetch import LayerPrefetcher
from specter.offload.runtime import Charger, OffloadRuntime, verification
from specter.offload.store import HostExpertStore, host_store

NO_TRANSFERS = LinkProfile(bandwidth_Bps=1e18, latency_s=0.0)  # real-time runs that move nothing


class NoCharge:
    """Real clocks: compute takes the time it takes; nothing to charge."""

    def begin_forward(self, tokens: int, context: int, prefill: bool = False,
                      rows: int = 1) -> None:
        pass

    def remove(self) -> None:
        pass


@dataclass
class Timing:
    link: Link
    cost: CostModel | None  # None on real clocks without a profile
    clock: str  # virtual | emulated | wall | cuda
    time_scale: float = 1.0  # emulated: this machine's step time / the profile's
    # Real clocks with a profile (e.g. hardware=h200_measured hardware.clock=wall): its rates
    # at this model's own sizes, for decisions only (host-computed misses); never charged.
    rates: CostModel | None = None

    @staticmethod
    def wall(device: torch.device) -> "Timing":
        kind = "cuda" if device.type == "cuda" else "wall"
        return Timing(link=make_link(kind, NO_TRANSFERS, device), cost=None, clock=kind)

    def charger(self, model, charge_experts: bool):
        if self.clock != "virtual":
            return NoCharge()
        return Charger(model, self.link, self.cost, charge_experts)

    def link_record(self) -> dict:
        s = self.link.stats()
        rec = {"clock": self.clock, "n_transfers": s.n_transfers, "h2d_bytes": s.h2d_bytes,
               "h2d_ms": s.h2d_s * 1e3, "exposed_wait_ms": s.exposed_wait_s * 1e3,
               "h2d_hidden_frac": s.hidden_frac, "time_scale": self.time_scale,
               # host-computed misses (virtual clock): the host's busy time, the device's wait
               "host_busy_ms": getattr(self.link, "host_busy_s", float("nan")) * 1e3,
               "host_wait_ms": getattr(self.link, "host_wait_s", float("nan")) * 1e3}
        if self.cost is not None:
            rec.update(self.cost.sizes.as_record())
            rec["engine"] = self.cost.hw.engine  # ideal | hf: which engine the profile models
        return rec


def has_device_profile(hw: HardwareConfig) -> bool:
    return hw.matrix_flops > 0 and hw.mem_bandwidth_Bps > 0 and hw.h2d_bandwidth_Bps > 0


def profile_of(hw: HardwareConfig) -> HardwareProfile:
    if not has_device_profile(hw):
        raise UserError(f"hardware={hw.name} has no device profile (matrix_flops, "
                        "mem_bandwidth_Bps, h2d_bandwidth_Bps) for the "
                        f"{hw.clock} clock; use a GPU profile: hardware=a100_pcie4_hf, a100_pcie4_ideal, h200_hf, h200_ideal or h200_measured.")
    constants = {k: getattr(hw, k) for k in ("launch_overhead_s", "layer_overhead_s",
                                             "expert_overhead_s", "draft_overhead_s",
                                             "offload_layer_overhead_s")}
    if (hw.host_op_s > 0 or hw.sync_s > 0) and any(constants.values()):
        raise UserError(f"hardware={hw.name} charges host costs from counts (host_op_s, sync_s) "
                        "and as constants too ("
                        + ", ".join(k for k, v in constants.items() if v)
                        + "); a counted profile sets those to 0.")
    return HardwareProfile(name=hw.name, matrix_flops=hw.matrix_flops,
                           mem_bandwidth_Bps=hw.mem_bandwidth_Bps,
                           launch_overhead_s=hw.launch_overhead_s,
                           h2d_bandwidth_Bps=hw.h2d_bandwidth_Bps, h2d_latency_s=hw.h2d_latency_s,
                           host_matrix_flops=hw.host_matrix_flops,
                           host_mem_bandwidth_Bps=hw.host_mem_bandwidth_Bps,
                           layer_overhead_s=hw.layer_overhead_s,
                           expert_overhead_s=hw.expert_overhead_s, engine=hw.engine,
                           draft_overhead_s=hw.draft_overhead_s,
                           offload_layer_overhead_s=hw.offload_layer_overhead_s,
                           host_op_s=hw.host_op_s, sync_s=hw.sync_s)


def charges_real_sizes(charge: str, model_name: str, stands_for: str | None) -> bool:
    """hardware.charge: "real" (the real model's sizes), "own" (this model's), or "auto" (the
    real model's where this one stands for a real one, its own otherwise)."""
    if charge not in ("auto", "own", "real"):
        raise UserError(f"hardware.charge must be auto, own or real (got '{charge}').")
    has_real = (stands_for or model_name) in REAL_CONFIGS
    if charge == "real" and not has_real:
        raise UserError(f"hardware.charge=real needs a model that stands for a real one "
                        f"(deepseek, qwen, phi); model={model_name} does not: use "
                        "hardware.charge=auto or own.")
    return charge == "real" or (charge == "auto" and has_real)


def sizes_for(model, hw: HardwareConfig, model_name: str, stands_for: str | None) -> ChargedSizes:
    """The charged sizes (own or real) at the weights' bits `hw` charges."""
    sizes = _sizes_for(model, hw, model_name, stands_for)
    return dataclasses.replace(sizes, expert_bits=hw.expert_bits, attn_bits=hw.attn_bits,
                               quant_group=hw.quant_group, quant_meta_bytes=hw.quant_meta_bytes,
                               attn_quant_group=hw.attn_quant_group)


def _sizes_for(model, hw: HardwareConfig, model_name: str, stands_for: str | None) -> ChargedSizes:
    elem = next(model.parameters()).element_size()
    if not charges_real_sizes(hw.charge, model_name, stands_for):
        return charged_sizes(model, f"own:{model_name}", elem)
    real = REAL_CONFIGS.get(stands_for or model_name)
    if real is None:
        raise UserError(f"hardware.charge=real needs a model that stands for a real one "
                        f"(deepseek, qwen, phi); model={model_name} does not.")
    return real_charged_sizes(real, layer_counts(model), elem_bytes=2)


def timing_for(job) -> Timing:
    """The clock and link a system runs under, from the job's `ClockSpec` (specs.py)."""
    hw, device, clock = job.clock.hardware, job.device, job.clock
    if hw.clock == "wall":
        if not has_device_profile(hw):
            return Timing.wall(device)
        profile = profile_of(hw)  # real time; the profile's rates inform decisions only
        kind = "cuda" if device.type == "cuda" else "wall"
        link = make_link(kind, LinkProfile(bandwidth_Bps=profile.h2d_bandwidth_Bps,
                                           latency_s=profile.h2d_latency_s), device)
        own = sizes_for(job.loaded.model, dataclasses.replace(hw, charge="own"),
                        clock.model, clock.stands_for)
        return Timing(link=link, cost=None, clock=kind, rates=CostModel(profile, own))
    profile = profile_of(hw)
    sizes = sizes_for(job.loaded.model, hw, clock.model, clock.stands_for)
    cost = CostModel(profile, sizes)
    link_profile = LinkProfile(bandwidth_Bps=profile.h2d_bandwidth_Bps,
                               latency_s=profile.h2d_latency_s)
    if hw.clock == "virtual":
        return Timing(link=make_link("virtual", link_profile, device), cost=cost, clock="virtual")
    if hw.clock == "emulated":
        scale = calibrate_time_scale(job.loaded.model, device, cost)
        slowed = LinkProfile(bandwidth_Bps=profile.h2d_bandwidth_Bps / scale,
                             latency_s=profile.h2d_latency_s * scale)
        link = make_link("wall", slowed, device)
        link.time_scale = scale  # host jobs last their modelled seconds, scaled alike
        return Timing(link=link, cost=cost, clock="emulated", time_scale=scale)
    raise UserError(f"hardware.clock must be wall, virtual or emulated (got '{hw.clock}').")


@torch.no_grad()
def calibrate_time_scale(model, device: torch.device, cost: CostModel, steps: int = 16) -> float:
    """How much slower this machine decodes than the profile: measured wall seconds of
    `steps` decode steps / their virtual seconds under the cost model (same model, all
    experts resident), so emulated transfers keep the profile's transfer:compute ratio."""
    from specter.engine import forward_logits, new_cache

    virtual = make_link("virtual", NO_TRANSFERS, device)
    charger = Charger(model, virtual, cost, charge_experts=True)
    try:
        cache = new_cache(model)
        tok = torch.tensor([[1] * 16], device=device)
        charger.begin_forward(16, 16)
        forward_logits(model, tok, cache)
        t0_virtual, t0 = virtual.now(), time.perf_counter()
        for i in range(steps):
            charger.begin_forward(1, 17 + i)
            forward_logits(model, tok[:, :1], cache)
        wall_s, virtual_s = time.perf_counter() - t0, virtual.now() - t0_virtual
    finally:
        charger.remove()
        virtual.close()
    return wall_s / virtual_s


WALL_CLOCK_OFFLOAD = ("offloading on the CPU needs a modelled link: use hardware=a100_pcie4_hf "
                      "(virtual clock) or hardware=a100_pcie4_hf hardware.clock=emulated, or "
                      "budget=full (every expert resident: the CPU's own clock).")


def refuse_wall_clock_offload(clock: str, device, slots: int, num_experts: int) -> None:
    """The one rule for copying experts under the CPU's own clock: there is no link to time
    (a wall-clock run on the CPU copies in memory), so a run that holds some experts but not
    all (0 < slots < experts) needs a modelled link. Every expert resident (budget=full) or
    none held (host_experts) copies nothing while decoding: the CPU's clock times the compute."""
    if clock == "wall" and torch.device(device).type == "cpu" and 0 < slots < num_experts:
        raise UserError(WALL_CLOCK_OFFLOAD)


def check_host_rates(rates: CostModel | None, clock: str) -> None:
    """Host-computed misses decide from modelled rates (the virtual or emulated clock's cost
    model, or a real clock's profile): refused without them, in one sentence."""
    if rates is None:
        raise UserError(f"host-computed misses (system.host_compute, the *_hybrid systems) decide "
                        f"from the host's and the link's rates, which this {clock} clock "
                        "has no profile for: give a measured one, e.g. hardware=h200_measured "
                        "hardware.clock=wall (scripts/calibrate_gpu.py writes it), or use a "
                        "virtual clock, e.g. hardware=a100_pcie4_hf.")
    if not (rates.hw.host_matrix_flops > 0 and rates.hw.host_mem_bandwidth_Bps > 0):
        raise UserError(f"host-computed misses need the host's rates: hardware="
                        f"{rates.hw.name} has no host_matrix_flops / host_mem_bandwidth_Bps.")


def offload_model(job, timing: Timing, prefetcher: LayerPrefetcher | None = None, *,
                  host_all: bool = False, host_misses: bool = False, serial: bool = False,
                  overlap: bool = True) -> OffloadRuntime:
    """Move the model's routed experts to host memory with the job's `OffloadSpec` (specs.py:
    its slots per layer on the device, its eviction policy, its kernel), through `timing`'s
    link, and the runtime that computes them, complete: `host_all` (the host_experts systems):
    no slots, every routed expert computed on the host; `host_misses`: a miss the host would
    finish sooner than its copy is computed there (refused without the rates that decide);
    `serial` (one GEMV per token and expert) and `overlap=False` (serial demand loading): the
    runtime's ablations (runtime.py `verification`)."""
    spec = job.offload
    slots = 0 if host_all else spec.slots
    refuse_wall_clock_offload(timing.clock, job.device, slots, job.loaded.spec.num_experts)
    rates = timing.cost or timing.rates
    if host_misses:
        check_host_rates(rates, timing.clock)
    model, device = job.loaded.model, job.device
    store = host_store(model)  # the plan put the experts in host memory (placement/loader.py)
    if store is not None:
        store.adopt(model)
    else:  # a model loaded whole (the plan's "device": tests, load_peak's comparison): the
        # fused parameters move out layer by layer
        store = HostExpertStore.from_model(model, pin=device.type == "cuda")
    transfer_bytes = timing.cost.expert_transfer_bytes() if timing.cost else None
    cache = ExpertCache(store, slots, device, timing.link, policy_named(spec.policy),
                        transfer_bytes=transfer_bytes, staging=spec.staging)
    compute = verification(device, store.layout.dtype, spec.grouped, serial, overlap)
    return OffloadRuntime(model, cache, timing.link, timing.cost, prefetcher, compute=compute,
                          rates=rates, host_misses=host_misses, host_all=host_all)
