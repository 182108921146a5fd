"""Which clock a run keeps: a run's hardware config -> its link, its cost model, its observer.

Owns: the one place where the clock's capabilities are decided (virtual, emulated or real
clock; CUDA or CPU), the charged sizes (this model's own or the real model's it stands for),
the emulated clock's calibration, and `Timing`, what a system runs under: the link (time and
copies), the cost model (None on real clocks) and `observer(model)` (observer.py).
Does not own: moving expert bytes (offload/), what each step costs (costmodel.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from specter.clock.kinds import ClockKind, clock_kind
from specter.clock.costmodel import (ChargedSizes, CostModel, HardwareProfile, charged_sizes,
                                     layer_counts, real_charged_sizes)
from specter.clock.observer import NULL_CLOCK, ComputeClock, NullClock, VirtualLink
from specter.config import HardwareConfig
from specter.errors import UserError
from specter.models.real_configs import REAL_CONFIGS
from specter.offload.link import CudaLink, Link, LinkProfile, WallLink

NO_TRANSFERS = LinkProfile(bandwidth_Bps=1e18, latency_s=0.0)  # real-time runs that move nothing
KINDS = ("virtual", "wall", "cuda")  # the links make_link builds


@dataclass
class Timing:
    link: Link
    cost: CostModel | None  # None on real clocks without a profile
    clock: str  # virtual | emulated | wall | cuda
    time_scale: float = 1.0  # emulated: this machine's step time / the profile's
    # Real clocks with a profile (e.g. hardware=h200_measured hardware.clock=wall): its rates
    # at this model's own sizes, for decisions only (host-computed misses); never charged.
    rates: CostModel | None = None

    @property
    def kind(self) -> ClockKind:
        """What this clock is, by trait (kinds.py): ask `timing.kind.real`, never its name."""
        return clock_kind(self.clock)

    @property
    def charged(self) -> bool:
        """Whether compute steps are charged by the cost model (the virtual clock)."""
        return self.cost is not None and self.kind.charged

    @staticmethod
    def wall(device: torch.device) -> "Timing":
        kind = "cuda" if device.type == "cuda" else "wall"
        return Timing(link=make_link(kind, NO_TRANSFERS, device), cost=None, clock=kind)

    def observer(self, model, charge_experts: bool) -> NullClock:
        """The clock a model's forwards report to (observer.py): priced on the virtual clock,
        a no-op on the others (the emulated clock's compute takes its own time)."""
        if not self.charged:
            return NULL_CLOCK
        return ComputeClock(self.link, self.cost, model, charge_experts)

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
    if hw.kernel_floor_s < 0:
        raise UserError(f"hardware.kernel_floor_s must be 0 or more (got {hw.kernel_floor_s}).")
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
                           host_op_s=hw.host_op_s, sync_s=hw.sync_s,
                           kernel_floor_s=hw.kernel_floor_s)


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
        link = make_link("wall", slowed, device, time_scale=scale)  # host jobs scaled alike
        return Timing(link=link, cost=cost, clock="emulated", time_scale=scale)
    raise UserError(f"hardware.clock must be wall, virtual or emulated (got '{hw.clock}').")


@torch.no_grad()
def calibrate_time_scale(model, device: torch.device, cost: CostModel, steps: int = 16) -> float:
    """How much slower this machine decodes than the profile: measured wall seconds of
    `steps` decode steps / their virtual seconds under the cost model (same model, all
    experts resident), so emulated transfers keep the profile's transfer:compute ratio."""
    from specter.models.introspect import forward_logits, new_cache

    virtual = make_link("virtual", NO_TRANSFERS, device)
    clock = ComputeClock(virtual, cost, model, charge_experts=True)
    try:
        cache = new_cache(model)
        tok = torch.tensor([[1] * 16], device=device)
        clock.begin_forward(16, 16)
        forward_logits(model, tok, cache)
        t0_virtual, t0 = virtual.now(), time.perf_counter()
        for i in range(steps):
            clock.begin_forward(1, 17 + i)
            forward_logits(model, tok[:, :1], cache)
        wall_s, virtual_s = time.perf_counter() - t0, virtual.now() - t0_virtual
    finally:
        clock.remove()
        virtual.close()
    return wall_s / virtual_s


def make_link(kind: str, profile: LinkProfile, device: torch.device | str,
              time_scale: float = 1.0) -> Link:
    """The link of `kind` ("virtual" | "wall" | "cuda") for copies into `device`; a wall link
    of the emulated clock takes its `time_scale` (real seconds per modelled second)."""
    device = torch.device(device)
    if kind == "virtual":
        return VirtualLink(profile, device)
    if kind == "wall":
        return WallLink(profile, device, time_scale)
    if kind == "cuda":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise UserError(f"link=cuda needs a CUDA GPU and a cuda device (got {device}, "
                            f"cuda available: {torch.cuda.is_available()}); use link=virtual "
                            "or link=wall on this machine.")
        return CudaLink(profile, device)
    raise UserError(f"unknown link kind {kind!r}; choose one of {', '.join(KINDS)}.")
