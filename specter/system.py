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

from baselines.lru_s import SpeculativeOffloadEngine, build_speculative
from specter.pio.elb import ExpertLookaheadBuffer
from specter.pio.orchestrator import Orchestrator
from specter.spec.decode import CopiedKVDraft


class SpecterEngine(SpeculativeOffloadEngine):
    """A speculative engine whose draft routing drives an `Orchestrator` (or none)."""

    def __init__(self, *args, plan_mode: str | None, top_m: int, cold_start: float,
                 noise: float, seed: int, reorder: bool = True, draft_model=None,
                 bandwidth_prior: float | None = None, kv_copy: bool = False,
                 overlap: bool = True, cold_start_round: str = "floor",
                 final_plan: bool = False, wait_last_batch: bool = True,
                 bandwidth_prior_Bps: float | None = None, step_prior_s: float | None = None,
                 **kwargs):
        """`bandwidth_prior`: the planner's H2D bandwidth until copies are measured when
        `bandwidth_prior_Bps` is None (default the link profile's; real-time links have none,
        so the runner passes the hardware's). `bandwidth_prior_Bps` / `step_prior_s`: the
        artifact's priors, blended into the running averages; None: ours (the profile's
        bandwidth, no step time, each replaced by the first measurement)."""
        super().__init__(*args, **kwargs)
        if draft_model is not None:
            self.attach_separate_draft(draft_model, kv_copy=kv_copy)
        self.runtime.serial = not reorder
        self.runtime.overlap = overlap
        self.orch: Orchestrator | None = None
        if plan_mode is not None:
            cache, link = self.runtime.cache, self.timing.link
            elb = ExpertLookaheadBuffer(len(cache.layers), cache.layout.num_experts, self.device)
            cost = self.timing.cost
            self.orch = Orchestrator(
                self.runtime, link, elb, slots=cache.slots, top_m=top_m,
                bandwidth_Bps=bandwidth_prior_Bps or bandwidth_prior or link.profile.bandwidth_Bps,
                step_s=step_prior_s or 0.0,
                blend_priors=(bandwidth_prior_Bps is not None, step_prior_s is not None),
                latency_s=link.profile.latency_s,
                mode=plan_mode, cold_start=cold_start, noise=noise, seed=seed,
                sync_s=cost.hw.launch_overhead_s if cost is not None else 0.0,
                cold_start_round=cold_start_round, final_plan=final_plan,
                wait_last_batch=wait_last_batch)
            self.draft_instance.draft_listeners.append(self.orch.on_draft_experts)
        self.plan_mode = plan_mode
        self.priors = (bandwidth_prior_Bps, step_prior_s)

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
        """The run's rules beside its statistics: every row says which variant ran."""
        copied = isinstance(self.separate, CopiedKVDraft)
        rec = {"plan_mode": self.plan_mode or "none", "shared_instance": self.separate is None,
               "reorder": not self.runtime.serial, "overlap": self.runtime.overlap,
               "draft_kv": "shared" if self.separate is None else "copied" if copied else "own",
               "kv_copy_bytes": self.kv_copy_bytes, "kv_copies": self.kv_copies}
        if self.orch is not None:
            o = self.orch
            rec.update(o.stats.as_record())
            rec.update({"top_m": o.top_m, "wait_last_batch": o.wait_last_batch})
            if o.mode == "pio":  # the phases' rules (a single plan has no boundaries to size)
                rec.update({"cold_start_round": o.cold_start_round, "final_plan": o.final_plan,
                            "bandwidth_prior_Bps": self.priors[0],
                            "step_prior_s": self.priors[1],
                            "bandwidth_ema_Bps": o.bandwidth.value,
                            "draft_step_ema_s": o.step_s.value})
        return rec


def build_planned(ctx, name: str, plan_mode: str | None) -> SpecterEngine:
    """system.top_m unset: M = the slots (the artifact's: a plan may fill every slot)."""
    sc = ctx.cfg.system
    return build_speculative(
        ctx, name, engine_cls=SpecterEngine, separate=not sc.shared, plan_mode=plan_mode,
        top_m=sc.top_m or ctx.budget.slots, cold_start=sc.cold_start,
        noise=sc.prefetch_noise, seed=ctx.cfg.seed, reorder=sc.reorder,
        kv_copy=sc.kv_copy, overlap=sc.overlap, cold_start_round=sc.cold_start_round,
        final_plan=sc.final_plan, wait_last_batch=sc.wait_last_batch,
        bandwidth_prior_Bps=sc.bandwidth_prior_Bps, step_prior_s=sc.step_prior_s,
        # Real-time links (CUDA) carry no profile: start from the hardware's nominal PCIe
        # bandwidth (or PCIe 4.0 x16's 25 GB/s effective) until copies are measured.
        bandwidth_prior=None if ctx.cfg.hardware.clock in ("virtual", "emulated")
        else (ctx.cfg.hardware.h2d_bandwidth_Bps or 25e9))


def build(ctx) -> SpecterEngine:
    return build_planned(ctx, "specter", "pio" if ctx.cfg.system.orchestrator else None)
