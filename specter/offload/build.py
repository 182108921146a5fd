"""Assembly: a model's routed experts offloaded under a run's clock, and the rules for it.

Owns: building an `OffloadRuntime` for a model and budget (`offload_model`: store, cache,
verification strategy, host rates), the refusal of an offloading run the CPU's own clock cannot
time, and the check that host-computed misses have rates to decide from. The clock and link a
run keeps are the clock's (specter/clock/timing.py `timing_for`).
"""

from __future__ import annotations

import torch

from specter.clock.costmodel import CostModel
from specter.clock.kinds import ClockKind
from specter.clock.timing import Timing
from specter.errors import UserError
from specter.offload.cache import ExpertCache
from specter.offload.policy import policy_named
from specter.offload.prefetch import LayerPrefetcher
from specter.offload.runtime import OffloadRuntime, verification
from specter.offload.store import HostExpertStore, host_store

WALL_CLOCK_OFFLOAD = ("offloading on the CPU needs a modelled link: use hardware=a100_pcie4_hf "
                      "(virtual clock) or hardware=a100_pcie4_hf hardware.clock=emulated, or "
                      "budget=full (every expert resident: the CPU's own clock).")


def refuse_wall_clock_offload(clock: ClockKind, device, slots: int, num_experts: int) -> None:
    """The one rule for copying experts under the CPU's own clock: there is no link to time
    (a wall-clock run on the CPU copies in memory), so a run that holds some experts but not
    all (0 < slots < experts) needs a modelled link. Every expert resident (budget=full) or
    none held (host_experts) copies nothing while decoding: the CPU's clock times the compute."""
    if not clock.times_copies and torch.device(device).type == "cpu" and 0 < slots < num_experts:
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
    refuse_wall_clock_offload(timing.kind, job.device, slots, job.loaded.spec.num_experts)
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
