"""`system=specter`: the full system (docs/paper-notes.md): the shared INT4 self-draft (SIC),
speculative decoding with verification that keeps the target's output, the predictive I/O
orchestrator (PIO: ELB, three-phase planner, verification residency), and expert-grouped
verification (SEE's reordering).

Ablation switches (`system.*`, conf/system/specter.yaml): `orchestrator=false` loads the
target's experts on demand only; `shared=false` drafts with a second instance (copied
non-expert weights; `kv_copy=true`, the artifact's "SIC off": the target's committed KV copied
to it at each window's start and charged as a device copy; `kv_copy=false`: its own KV cache,
catching up on the tokens it has not seen); `reorder=false` verifies token by token (one GEMV
per token and expert); `overlap=false` loads verification's misses serially (each copied and
waited for before anything else computes: the ablation's "none"). The planner's rules where
the authors' artifact and our first reading differ (`cold_start_round`, `top_m`,
`final_plan`, `wait_last_batch`, `bandwidth_prior_Bps`, `step_prior_s`) default to the
artifact's; every run's records name the rules that ran. `spec.k` as for every speculating
system (auto: profiled with this very engine). The same engine with a single early or late
plan is `sp_e` / `sp_l` (baselines/single_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.budget import Footprint
from specter.config import SystemConfig
from specter.decoding.draft import SelfInt4Draft, SeparateInt4Draft, load_separate_draft_model
from specter.decoding.engines import SpeculativeEngine, build_speculative
from specter.pio.elb import ExpertLookaheadBuffer
from specter.pio.orchestrator import Orchestrator, PlanRules
from specter.errors import UserError
from specter.quant.build import int4_experts_for

ENGINE = SpeculativeEngine


@dataclass
class SpecterConfig(SystemConfig):
    """Specter's knobs (conf/system/specter.yaml says what each one switches)."""

    orchestrator: bool = True  # the predictive I/O orchestrator (False: on-demand loads only)
    shared: bool = True  # one instance for draft and target (False: a second instance)
    reorder: bool = True  # verification grouped by expert (False: one GEMV per token, serially)
    top_m: int | None = None  # experts per layer per prefetch batch; None: the slots (artifact)
    cold_start: float = 0.2  # first plan after this fraction of the window's draft steps
    prefetch_noise: float = 0.0  # experiment=oracle: share of planned expert IDs made wrong
    # Where the authors' artifact and our first reading differ (defaults: the artifact's).
    cold_start_round: str = "floor"  # first boundary max(1, int(f*K)); "ceil": ceil(f*K)
    final_plan: bool = False  # True: one last plan after the last draft step (ours before)
    wait_last_batch: bool = True  # verify once the last batch landed (False: per-expert waits)
    overlap: bool = True  # False: serial demand loading, no copy/compute overlap (ablation "none")
    kv_copy: bool = True  # shared=false: target's KV copied to the draft per window (False: own KV)
    bandwidth_prior_Bps: float | None = 12e9  # planner's bandwidth prior; None: the link profile's
    step_prior_s: float | None = 1e-3  # planner's draft-step prior; None: none (first measurement)
    # A miss computed on the host when that ends sooner than its copy (offload/runtime.py);
    # None: the system's default (specter: off, specter_hybrid: on).
    host_compute: bool | None = None

    def validate(self) -> None:
        if not 0.0 <= self.prefetch_noise <= 1.0:
            raise UserError(f"system.prefetch_noise must be in [0, 1] (got {self.prefetch_noise}).")
        if not 0.0 < self.cold_start <= 1.0:
            raise UserError(f"system.cold_start must be in (0, 1] (got {self.cold_start}).")
        if self.top_m is not None and self.top_m < 1:
            raise UserError(f"system.top_m must be at least 1 (got {self.top_m}).")
        if self.cold_start_round not in ("floor", "ceil"):
            raise UserError(f"system.cold_start_round must be floor or ceil "
                            f"(got '{self.cold_start_round}').")
        for key in ("bandwidth_prior_Bps", "step_prior_s"):
            value = getattr(self, key)
            if value is not None and not (0 < value < float("inf")):
                raise UserError(f"system.{key} must be a positive number or null (got {value}).")


Config = SpecterConfig


def footprint(system: SpecterConfig) -> Footprint:
    """The INT4 copy on the device, and a second instance when the draft does not share."""
    return Footprint(int4_draft=True, second_instance=not system.shared)


def orchestrator_for(job, sc: SpecterConfig, plan_mode: str):
    """The window prefetcher: the PIO planner ("pio") or one single plan ("early", "late").
    system.top_m unset: M = the slots (the artifact's: a plan may fill every slot). The
    planner's bandwidth prior: `system.bandwidth_prior_Bps` (the artifact's, blended into the
    running average), else the link profile's; real-time links (CUDA) carry no profile, so the
    hardware's nominal PCIe bandwidth (or PCIe 4.0 x16's 25 GB/s effective) until measured."""
    hw = job.clock.hardware
    real_time = hw.kind.real

    def make(runtime, timing, draft) -> Orchestrator:
        cache, link = runtime.cache, timing.link
        fallback = (hw.h2d_bandwidth_Bps or 25e9) if real_time else link.profile.bandwidth_Bps
        rules = PlanRules(
            top_m=sc.top_m or job.offload.slots, mode=plan_mode,
            bandwidth_Bps=sc.bandwidth_prior_Bps or fallback, step_s=sc.step_prior_s or 0.0,
            blend_priors=(sc.bandwidth_prior_Bps is not None, sc.step_prior_s is not None),
            priors=(sc.bandwidth_prior_Bps, sc.step_prior_s), cold_start=sc.cold_start,
            noise=sc.prefetch_noise, seed=job.seed, cold_start_round=sc.cold_start_round,
            final_plan=sc.final_plan,
            # With host-computed misses verification does not wait for the last batch as a
            # whole: an expert still in flight is computed on the host when that is sooner.
            wait_last_batch=sc.wait_last_batch and not host_compute_on(sc))
        return Orchestrator(
            runtime, link, ExpertLookaheadBuffer(len(cache.layers), cache.layout.num_experts,
                                                 job.device),
            rules, slots=cache.slots, latency_s=link.profile.latency_s,
            clock=timing.observer(None, False))
    return make


def build_planned(job, name: str, plan_mode: str | None, sc: SpecterConfig) -> SpeculativeEngine:
    """Specter's parts under settings `sc`: the INT4 self-draft (or, shared=false, a second
    instance), the orchestrator in `plan_mode` (None: on-demand loads only), expert-grouped
    verification."""
    draft = int4_experts_for(job)  # from the full-precision experts, before they move out
    if sc.shared:
        make_draft = lambda timing, _, compiled: SelfInt4Draft(  # noqa: E731
            job.loaded.model, draft, job.device, timing, compiled)
    else:
        second = load_separate_draft_model(job)
        make_draft = lambda timing, _, compiled: SeparateInt4Draft(  # noqa: E731
            job.loaded.model, second, draft, job.device, timing, kv_copy=sc.kv_copy,
            compiled=compiled)
    return build_speculative(job, name, make_draft,
                             window=orchestrator_for(job, sc, plan_mode) if plan_mode else None,
                             reorder=sc.reorder, overlap=sc.overlap,
                             host_compute=host_compute_on(sc), int4=draft,
                             copied_kv=not sc.shared and sc.kv_copy)


def host_compute_on(sc: SystemConfig) -> bool:
    """`system.host_compute`, else the system's default: on for the `*_hybrid` systems."""
    value = getattr(sc, "host_compute", None)
    return sc.name.endswith("_hybrid") if value is None else bool(value)


def build(job) -> SpeculativeEngine:
    """`specter`, or `specter_hybrid` (the same with host-computed misses on by default)."""
    sc = job.system
    return build_planned(job, sc.name, "pio" if sc.orchestrator else None, sc)
