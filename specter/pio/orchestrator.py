"""The orchestrator: the draft's routing -> the ELB -> plans -> held loads into the cache.

Owns: when plans happen within a draft window (the planner's phases, or a single early or
late plan for the SP-E / SP-L baselines), issuing each plan as holds and loads on the expert
cache (holds first, then loads in layer order: the order verification needs them), the running
averages of bandwidth and draft-step time that size the chunks, and the per-window prefetch
statistics (precision of the loads, how much of verification's demand the plan covered).
Does not own: the counters (elb.py), the rules (planner.py), eviction (cache.py and policy.py),
the verification's own demand loading (offload/runtime.py: the target router stays
authoritative; a layer's holds are released as soon as its verification starts).

With host-computed misses on (`specter_hybrid`), each plan also hands the host the predicted
experts it could not load (`runtime.host.prepare`, offload/host.py): beside a GPU their fp32
copies are made on the host thread during the draft, not on verification's critical path.

Hooks: `on_draft_experts(layer, top_k_index)` from the draft instance (wired by the engine);
the loop's events (decoding/loop.py `Events`): `forward(phase, tokens, context, rows)` before
every forward, `draft_step(i, k_eff)` after each draft token, `window_end()` after each
verification; `reset()` before each request.

Rules where the authors' artifact and our first reading differ, each a switch whose default
is the artifact's (system.* in conf/system/specter.yaml): the first boundary's rounding
(`cold_start_round`), no plan after the last draft step (`final_plan=False`; True: one last
plan with the whole window's counts), verification starting only once the last batch has
landed (`wait_last_batch=True`; False: verification waits per expert on its own copy), and
the running averages' priors (12 GB/s and 1 ms, blended into the average as the artifact's
EMA does; None: the link profile's bandwidth and no step time, replaced by the first sample).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specter.clock.observer import NULL_CLOCK, NullClock
from specter.offload.link import Link, Transfer
from specter.offload.prefetch import WindowPrefetcher
from specter.offload.runtime import OffloadRuntime
from specter.pio import planner
from specter.pio.elb import ExpertLookaheadBuffer

MODES = ("pio", "early", "late")  # the three-phase planner; one plan after step 1; one at the end


@dataclass
class PrefetchStats:
    windows: int = 0
    boundaries: int = 0  # plans made
    loads: int = 0  # experts copied by plans
    holds: int = 0  # predicted experts found resident and held
    loads_used: int = 0  # ... loaded experts that verification then needed
    demand: int = 0  # experts verification needed (per layer, per window)
    demand_planned: int = 0  # ... of them in the plan (held or loaded)
    corrupted: int = 0  # loads replaced by wrong IDs (experiment=oracle)
    full_windows: int = 0  # windows whose lookahead stopped because every plan was full
    last_batch_wait_s: float = 0.0  # wait_last_batch: compute-stream wait at verification start

    def as_record(self) -> dict:
        ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
        return {"window_prefetches": self.loads, "plan_holds": self.holds,
                "plan_boundaries_per_window": ratio(self.boundaries, self.windows),
                "prefetch_precision": ratio(self.loads_used, self.loads),
                "plan_recall": ratio(self.demand_planned, self.demand),
                "prefetch_corrupted": self.corrupted,
                "plan_full_frac": ratio(self.full_windows, self.windows),
                "last_batch_wait_ms": self.last_batch_wait_s * 1e3}


@dataclass(frozen=True)
class PlanRules:
    """How the orchestrator plans, settled once (specter_recipe.py `orchestrator_for`): `mode` ("pio",
    or one single plan per window: "early", "late"); `top_m` predicted experts per layer;
    `cold_start` (the fraction of the window before the first plan) and its rounding;
    `final_plan` (one more plan at the window's end); `wait_last_batch` (verification waits for
    the last batch as a whole); `noise` / `seed` (experiment=oracle's corrupted loads).
    `bandwidth_Bps` / `step_s`: the running averages' priors; `blend_priors` (for the
    bandwidth, for the step time): the prior is the average's starting value (the artifact's
    EMA) rather than replaced by the first sample. `priors`: the configured (bandwidth, step)
    priors as the records name them (None: the profile's / none)."""

    top_m: int
    bandwidth_Bps: float
    mode: str = "pio"
    cold_start: float = 0.2
    cold_start_round: str = "floor"
    final_plan: bool = False
    wait_last_batch: bool = True
    noise: float = 0.0
    seed: int = 0
    step_s: float = 0.0
    blend_priors: tuple[bool, bool] = (False, False)
    priors: tuple[float | None, float | None] = (None, None)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {self.mode!r})")
        if self.cold_start_round not in planner.ROUNDINGS:
            raise ValueError(f"cold_start_round must be one of {planner.ROUNDINGS} "
                             f"(got {self.cold_start_round!r})")


class Orchestrator(WindowPrefetcher):
    """Specter's window prefetcher (mode "pio"), or one single plan per window ("early",
    "late": SP-E / SP-L), planning by `rules` over `slots` resident slots per layer, the
    link's `latency_s` per copy; `clock` (clock/observer.py) charges the host's read of each
    ELB snapshot on the virtual clock."""

    def __init__(self, runtime: OffloadRuntime, link: Link, elb: ExpertLookaheadBuffer,
                 rules: PlanRules, *, slots: int, latency_s: float, clock: NullClock = NULL_CLOCK):
        r = rules
        self.runtime, self.cache, self.link, self.elb = runtime, runtime.cache, link, elb
        self.slots, self.top_m, self.mode = slots, r.top_m, r.mode
        # Staging buffers (budget.staging) let a layer's plan grow past its resident slots: by
        # its share of the pool, while buffers last (cache.stage).
        staging, layers = self.cache.staging, len(self.cache.layers)
        self.plan_cap = slots + (-(-staging // layers) if staging else 0)
        self.cold_start, self.noise, self.seed = r.cold_start, r.noise, r.seed
        self.cold_start_round, self.final_plan = r.cold_start_round, r.final_plan
        self.wait_last_batch = r.wait_last_batch
        self.latency_s, self.clock = latency_s, clock
        self.expert_bytes = self.cache.transfer_bytes
        self.bandwidth = planner.RunningMean(r.bandwidth_Bps, blend=r.blend_priors[0])
        self.step_s = planner.RunningMean(r.step_s, blend=r.blend_priors[1] and r.step_s > 0)
        self.priors = r.priors
        self.reset()

    def as_record(self) -> dict:
        """The plan's statistics and the rules that ran (every row says which variant)."""
        self._time_waits(wait=True)  # after the request: the device is past every mark
        rec = {"plan_mode": self.mode, **self.stats.as_record(), "top_m": self.top_m,
               "wait_last_batch": self.wait_last_batch}
        if self.mode == "pio":  # the phases' rules (a single plan has no boundaries to size)
            rec.update({"cold_start_round": self.cold_start_round, "final_plan": self.final_plan,
                        "bandwidth_prior_Bps": self.priors[0], "step_prior_s": self.priors[1],
                        "bandwidth_ema_Bps": self.bandwidth.value,
                        "draft_step_ema_s": self.step_s.value})
        return rec

    # --- lifecycle ---------------------------------------------------------------------
    def reset(self) -> None:
        self.stats = PrefetchStats()
        self.rng = random.Random(self.seed)
        self._steps: list[tuple] = []  # (start, end) marks of draft steps not yet timed
        self._waits: list[tuple] = []  # (start, end) marks of last-batch waits not yet timed
        self._new_window()

    def _new_window(self) -> None:
        self.elb.reset()
        n = len(self.cache.layers)
        self.planned: list[set[int]] = [set() for _ in range(n)]
        self.loaded: list[set[int]] = [set() for _ in range(n)]
        self.boundary: int | None = None
        self.stopped = False
        self.inflight: list[Transfer] = []
        self._t_step = None  # the link's mark at the current draft step's start

    # --- hooks -------------------------------------------------------------------------
    def on_draft_experts(self, layer: int, top_k_index) -> None:
        self.elb.add(layer, top_k_index)

    def on_draft_routes(self, routes) -> None:
        self.elb.add_all(routes)

    routes_in_graph = True  # the lookahead buffer's scatter: inside a captured draft step

    def forward(self, phase: str, tokens: int, context: int, rows: int = 1) -> None:
        if phase == "draft":
            self._t_step = self.link.mark()
        elif phase == "verify" and self.wait_last_batch:
            self._wait_last_batch()

    def draft_step(self, i: int, k_eff: int) -> None:
        if self._t_step is not None:
            self._steps.append((self._t_step, self.link.mark()))
        self._time_steps()
        if self.stopped:
            return
        if self.boundary is None:
            self.boundary = {"pio": planner.cold_start_steps(k_eff, self.cold_start,
                                                             self.cold_start_round),
                             "early": 1, "late": k_eff}[self.mode]
        if i < self.boundary and i < k_eff:
            return
        if self.mode == "pio" and i >= k_eff and not self.final_plan:
            self.stopped = True  # the artifact: no plan after the last draft step
            return
        batch_s = self._plan()
        if self.mode != "pio" or i >= k_eff:
            self.stopped = True
        elif planner.plan_full(self.planned, self.plan_cap):
            self.stopped = True
            self.stats.full_windows += 1
        else:  # Prefetch Overlap: the next chunk computes while this batch moves
            self.boundary = i + planner.next_chunk_steps(batch_s, self.step_s.value)

    def _timed(self, spans: list[tuple], add, wait: bool = False) -> None:
        """Pass each (start, end) mark pair the device has passed to `add(seconds)`, in order,
        without waiting unless `wait` (on CUDA an end event may still be queued: it is timed
        later, once reached; on modelled clocks every span at once)."""
        while spans:
            seconds = self.link.elapsed(*spans[0], wait=wait)
            if seconds is None:
                return
            add(seconds)
            spans.pop(0)

    def _time_steps(self) -> None:
        """The draft steps the device has finished, into the step-time EMA."""
        self._timed(self._steps, self.step_s.update)

    def _time_waits(self, wait: bool = False) -> None:
        """The last-batch waits the device has passed (all of them when `wait`)."""
        def add(seconds):
            self.stats.last_batch_wait_s += seconds
        self._timed(self._waits, add, wait)

    def _wait_last_batch(self) -> None:
        """Verification starts once every copy this window's plans issued has landed (the
        artifact blocks on the last batch's event; one FIFO copy engine: the same instant).
        The wait is the link's (exposed) and counted in `last_batch_wait_ms`."""
        t0 = self.link.mark()
        for l, experts in enumerate(self.loaded):
            for e in sorted(experts):
                self.cache.wait(l, e)  # no-op once landed and waited for
        self._waits.append((t0, self.link.mark()))
        self._time_waits()

    def window_end(self) -> None:
        """After verification: score the window's plan against the target's demand."""
        s = self.stats
        s.windows += 1
        for l, needed in self.runtime.stats.last_needed.items():
            need = set(needed)
            s.demand += len(need)
            s.demand_planned += len(need & self.planned[l])
            s.loads_used += len(need & self.loaded[l])
        self.cache.release_all_holds()
        self._new_window()

    # --- planning ----------------------------------------------------------------------
    def _plan(self) -> float:
        """Snapshot the ELB, plan every layer, hold and issue; returns the batch's modelled
        transfer seconds."""
        self._measure_bandwidth()
        counts = self.elb.snapshot()
        self.clock.host_read()
        resident = [self.cache.resident_set(l) for l in range(len(counts))]
        batch = planner.plan_batch(counts, resident, self.planned, self.plan_cap, self.top_m)
        self.stats.corrupted += planner.corrupt(batch, counts, resident, self.noise, self.rng)
        for l, b in enumerate(batch):  # holds first: this batch's loads must not evict them
            self.cache.hold(l, b.hold)
            self.planned[l].update(b.hold)
            self.stats.holds += len(b.hold)
        n = 0
        for l, b in enumerate(batch):
            # A prefetch only takes the slot of an expert the draft has not routed to: evicting
            # a predicted one would trade one needed copy for another.
            predicted = {e for e, c in enumerate(counts[l]) if c >= 1}
            for e in b.load:
                t = self.cache.load(l, e, avoid=predicted)
                if t is None:  # every slot held by a plan, a predicted expert or one in use:
                    t = self.cache.stage(l, e)  # a staging buffer, if there is one free
                if t is None:
                    break
                self.cache.hold(l, [e])
                self.planned[l].add(e)
                self.loaded[l].add(e)
                self.inflight.append(t)
                n += 1
        self.stats.loads += n
        self.stats.boundaries += 1
        if self.runtime.host.misses:  # the host starts on what the plan could not load
            for l, c in enumerate(counts):
                self.runtime.host.prepare(l, [e for e, n_e in enumerate(c)
                                              if n_e >= 1 and e not in self.planned[l]])
        return planner.batch_seconds(n, self.expert_bytes, self.bandwidth.value, self.latency_s)

    def _measure_bandwidth(self) -> None:
        left = []
        for t in self.inflight:
            span = self.link.span(t)  # (start, end) once landed; never a wait
            if span is not None and span[1] > span[0]:
                self.bandwidth.update(t.nbytes / max(span[1] - span[0] - self.latency_s, 1e-12))
            elif span is None:
                left.append(t)
        self.inflight = left
