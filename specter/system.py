"""`system=specter`: the full system (paper-facts.md): the shared INT4 self-draft (SIC),
speculative decoding with verification that keeps the target's output, the predictive I/O
orchestrator (PIO: ELB, three-phase planner, verification residency), and expert-grouped
verification (SEE's reordering).

Ablation switches (`system.*`, conf/system/specter.yaml): `orchestrator=false` loads the
target's experts on demand only; `shared=false` drafts with a second instance (copied
non-expert weights, its own KV cache); `reorder=false` verifies token by token (one GEMV per
token and expert). `spec.k` as for every speculating system (auto: profiled with this very
engine). The same engine with a single early or late plan is `sp_e` / `sp_l`
(baselines/single_plan.py).
"""

from __future__ import annotations

from baselines.lru_s import SpeculativeOffloadEngine, build_speculative
from specter.pio.elb import ExpertLookaheadBuffer
from specter.pio.orchestrator import Orchestrator


class SpecterEngine(SpeculativeOffloadEngine):
    """A speculative engine whose draft routing drives an `Orchestrator` (or none)."""

    def __init__(self, *args, plan_mode: str | None, top_m: int, cold_start: float,
                 noise: float, seed: int, reorder: bool = True, draft_model=None,
                 bandwidth_prior: float | None = None, **kwargs):
        """`bandwidth_prior`: the planner's H2D bandwidth until copies are measured (default
        the link profile's; real-time links have none, so the runner passes the hardware's)."""
        super().__init__(*args, **kwargs)
        if draft_model is not None:
            self.attach_separate_draft(draft_model)
        self.runtime.serial = not reorder
        self.orch: Orchestrator | None = None
        if plan_mode is not None:
            cache, link = self.runtime.cache, self.timing.link
            elb = ExpertLookaheadBuffer(len(cache.layers), cache.layout.num_experts, self.device)
            cost = self.timing.cost
            self.orch = Orchestrator(
                self.runtime, link, elb, slots=cache.slots, top_m=top_m,
                bandwidth_Bps=bandwidth_prior or link.profile.bandwidth_Bps,
                latency_s=link.profile.latency_s,
                mode=plan_mode, cold_start=cold_start, noise=noise, seed=seed,
                sync_s=cost.hw.launch_overhead_s if cost is not None else 0.0)
            self.draft_instance.draft_listeners.append(self.orch.on_draft_experts)
        self.plan_mode = plan_mode

    def _before_forward(self, tokens: int, context: int, phase: str) -> None:
        super()._before_forward(tokens, context, phase)
        if self.orch is not None:
            self.orch.on_forward(phase)

    def reset(self) -> None:
        super().reset()
        if self.orch is not None:
            self.orch.reset()

    def _decode_options(self) -> dict:
        opts = super()._decode_options()
        if self.orch is not None:
            opts["after_draft_step"] = self.orch.after_draft_step
            opts["on_window"] = lambda _stats: self.orch.end_window()
        return opts

    def _extra_stats(self) -> dict:
        rec = {"plan_mode": self.plan_mode or "none", "shared_instance": self.separate is None,
               "reorder": not self.runtime.serial}
        if self.orch is not None:
            rec.update(self.orch.stats.as_record())
            rec["top_m"] = self.orch.top_m
        return rec


def build_planned(ctx, name: str, plan_mode: str | None,
                  default_top_m: int | None = None) -> SpecterEngine:
    """`default_top_m`: experts per layer per plan when system.top_m is unset (else top-k)."""
    sc = ctx.cfg.system
    return build_speculative(
        ctx, name, engine_cls=SpecterEngine, separate=not sc.shared, plan_mode=plan_mode,
        top_m=sc.top_m or default_top_m or ctx.loaded.spec.top_k, cold_start=sc.cold_start,
        noise=sc.prefetch_noise, seed=ctx.cfg.seed, reorder=sc.reorder,
        # Real-time links (CUDA) carry no profile: start from the hardware's nominal PCIe
        # bandwidth (or PCIe 4.0 x16's 25 GB/s effective) until copies are measured.
        bandwidth_prior=None if ctx.cfg.hardware.clock in ("virtual", "emulated")
        else (ctx.cfg.hardware.h2d_bandwidth_Bps or 25e9))


def build(ctx) -> SpecterEngine:
    return build_planned(ctx, "specter", "pio" if ctx.cfg.system.orchestrator else None)
