"""The draft depth K: the one rule every speculative system follows (`settle_depth`), and
the per-window depth of `spec.k=adaptive` (`AdaptiveDepth`).

The rule: `spec.k=N` -> N; `spec.k=auto` -> the profiled K (`experiments/depth_profile.py`, run by the
harness on the built engine), except for a system with its own K, which keeps it (a baseline
runs at the depth its paper or artifact uses) unless `spec.tune_own_k=true` (a tuned-depth
baseline, reported as its own variant); `spec.k=adaptive` -> a K per window (`AdaptiveDepth`,
starting from the unset rule's K, at most `spec.k_max`); unset -> the system's own K if its
recipe has one (`OWN_K`: SpecMoEOff 3, SpecMoE 4, as their papers run them), else the model's
paper K (`model.paper_k`), else DEFAULT_K. Every record says which one applied (`k_source`).
The rule has one caller, `specter/recipes.py depth_of` (the recipe's `OWN_K` read there):
the build context settles it once and the engine is built with that `Depth`; the runner's
context check, before the weights load, asks `depth_of` for the deepest window (`k_max`).
Does not own: the engine (systems), the profiler (experiments/depth_profile.py), timing.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_K = 4  # spec.k unset, no system K, no paper K


@dataclass(frozen=True)
class Depth:
    """How deep a speculative engine drafts, settled once by `settle_depth`."""

    k: int  # every window's K (fixed), the first window's (adaptive), the K until profiled (auto)
    source: str  # what decided it, as records say it (`k_source`)
    mode: str  # "fixed" | "adaptive" | "auto" (profiled once the engine is built)
    k_max: int  # the most proposals one window may hold: its verification block is k_max + 1

    def policy(self, view: SlotView | None = None) -> AdaptiveDepth | None:
        """A fresh per-window depth for `adaptive` (with `view`: the slots and the link in
        view), else None (every window at `k`)."""
        return AdaptiveDepth(self.k, self.k_max, view=view) if self.mode == "adaptive" else None


def settle_depth(spec, paper_k: int | None, own_k: tuple[int, str] | None = None) -> Depth:
    """The rule above, for the run's `spec` settings, the model's paper K and the system's own
    K with its name (`OWN_K` of its recipe module, or None)."""
    k = spec.k
    if isinstance(k, int):
        return Depth(k, "spec.k", "fixed", k)
    if own_k is not None:
        base, source = own_k
    elif paper_k:
        base, source = paper_k, "model.paper_k"
    else:
        base, source = DEFAULT_K, f"default {DEFAULT_K}"
    if k == "adaptive":
        base = min(base, spec.k_max)
        return Depth(base, f"adaptive (from K={base}, {source}; k_max={spec.k_max})", "adaptive",
                     spec.k_max)
    if k == "auto" and own_k is not None and not spec.tune_own_k:
        return Depth(base, source + " (spec.k=auto keeps a system's own K; spec.tune_own_k=true "
                     "tunes it)", "fixed", base)
    if k == "auto":
        return Depth(base, source, "auto", max(base, *spec.profile_ks))
    return Depth(base, source, "fixed", base)


def distinct_experts(tokens: int, top_k: int, pool: float) -> float:
    """Distinct experts `tokens` tokens touch when each picks `top_k` of an effective pool of
    `pool` equally likely experts: pool * (1 - (1 - top_k / pool) ^ tokens)."""
    return pool * (1.0 - (1.0 - top_k / pool) ** tokens)


def effective_pool(tokens: int, distinct: int, top_k: int, num_experts: int) -> float:
    """The pool size that explains `distinct` experts over `tokens` tokens (`distinct_experts`
    inverted by bisection; between top_k and num_experts: a trained router's skew makes it
    smaller than the experts, uniform routing gives about all of them)."""
    lo, hi = float(top_k), float(num_experts)
    if distinct_experts(tokens, top_k, hi) <= distinct:
        return hi
    if distinct_experts(tokens, top_k, lo) >= distinct:
        return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if distinct_experts(tokens, top_k, mid) < distinct else (lo, mid)
    return (lo + hi) / 2


class SlotView:
    """What a window of depth K costs in copies, from the slots and the link: per MoE layer, the
    distinct experts K+1 tokens per row touch (`distinct_experts` over the layer's effective
    pool, fitted to every forward the runtime has routed: the prefill, then each
    verification), those beyond the layer's `slots` streamed through the link at `copy_s`
    seconds each. `sample()` reads the runtime's last forward (host data: no device read)."""

    def __init__(self, runtime, slots: int, num_experts: int, copy_s: float):
        self.runtime, self.slots, self.num_experts = runtime, slots, num_experts
        self.copy_s = copy_s
        self.top_k = 1  # the routing's, read with its first sample
        self.reset()

    def reset(self) -> None:
        self.pool_sum: dict[int, float] = {}  # per MoE layer: sum of fitted pools, weighted ...
        self.weight: dict[int, float] = {}  # ... by the forward's tokens
        self.rows = 1

    def sample(self) -> float:
        """Fit the pools to the runtime's last forward; returns its streamed experts (over all
        MoE layers: distinct experts beyond the slots)."""
        rt = self.runtime
        excess = 0.0
        for l, needed in rt.stats.last_needed.items():
            tokens, self.top_k = rt.stats.last_shape[l]
            if tokens < 1:
                continue
            pool = effective_pool(tokens, len(needed), self.top_k, self.num_experts)
            self.pool_sum[l] = self.pool_sum.get(l, 0.0) + tokens * pool
            self.weight[l] = self.weight.get(l, 0.0) + tokens
            excess += max(0, len(needed) - self.slots)
        return excess

    @property
    def ready(self) -> bool:
        return bool(self.weight)

    def distinct(self, k: int) -> list[float]:
        """Per MoE layer, the distinct experts a window of depth K touches (rows x (K+1)
        tokens)."""
        return [distinct_experts(self.rows * (k + 1), self.top_k, self.pool_sum[l] / self.weight[l])
                for l in sorted(self.weight)]

    def excess(self, k: int) -> float:
        """Experts a window of depth K streams beyond the slots, over all MoE layers."""
        return sum(max(0.0, d - self.slots) for d in self.distinct(k))

    def deepest_within_slots(self, k_max: int) -> int:
        """The largest K (at least 1) whose window touches no more experts than the slots, on
        the mean over MoE layers."""
        fits = [k for k in range(1, k_max + 1)
                if sum(self.distinct(k)) <= self.slots * len(self.weight)]
        return max(fits) if fits else 1

    def why(self, k: int) -> str:
        d = self.distinct(k)
        mean = sum(d) / len(d)
        return (f"{self.rows * (k + 1)} tokens touch {mean:.1f} experts per MoE layer for "
                f"{self.slots} slots (streaming {self.excess(k):.1f} per window at "
                f"{self.copy_s * 1e3:.3g} ms each)")


class AdaptiveDepth:
    """`spec.k=adaptive`: the draft depth of each window, from what the run has measured.

    Before a window it picks the K in 1..k_max with the most expected committed tokens per
    second of window: E(K) / (K * t_draft + t_verify(K)), where E(K) = (1 - a^(K+1)) / (1 - a)
    is the expected committed tokens of a row when each draft token is accepted with
    probability a (the accepted prefix plus the target's token), t_draft the measured time of
    one draft step and t_verify(K) = c + s * (K + 1) a line fitted to the measured
    verification times (least squares, slope >= 0; one depth measured: its mean time). a is
    the running acceptance, accepted / (accepted + rejections) with half a token of each as
    its prior (a rejection ends a row's window, so drafted tokens after it say nothing). The
    acceptance counts decay by `acceptance_decay` per window (a slow decay: a run of fully
    accepted windows must be long to argue for a deep K), the times by `time_decay` (the first
    windows run on a cold expert cache). A depth not measured yet is priced by the line, so
    the rule explores deeper while verification looks cheap and learns its slope there. Until
    both times are measured it keeps the starting K. Any K is lossless (verification decides):
    the rule changes speed only. Time is the run's clock (virtual: the cost model's).

    With a `SlotView` (the engine's, where experts are offloaded) K follows the slots: before
    the first window it starts at the deepest K whose window touches no more experts per MoE
    layer than the slots (from the prefill's routing), and t_verify(K) adds the copies of the
    experts a window of depth K would stream beyond the slots at the link's rate, so a deeper
    K is priced by the misses it brings, not by a line. `why` says what decided the last K
    (the record's `k_why`)."""

    def __init__(self, k0: int, k_max: int, acceptance_decay: float = 0.95,
                 time_decay: float = 0.8, view: SlotView | None = None):
        if not 1 <= k0 <= k_max:
            raise ValueError(f"starting K {k0} must lie in 1..{k_max}")
        self.k0, self.k_max = k0, k_max
        self.acceptance_decay, self.time_decay = acceptance_decay, time_decay
        self.view = view
        self.reset()

    def reset(self) -> None:
        """Before each request: the starting K and no measurements."""
        self.k = self.k0
        self.why = f"K={self.k0}: the starting K"
        self.accepted = self.rejected = 0.0
        self.step_s: float | None = None
        self.fit = [0.0] * 5  # decayed sums of w, w x, w x^2, w y, w x y; x = K + 1, y = seconds
        if self.view is not None:
            self.view.reset()

    def acceptance(self) -> float:
        return (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def verify_time(self, k: int) -> float:
        """The fitted verification time of a window of depth K (with a view: the line fitted
        to the times less their windows' streamed copies, plus the copies K would stream)."""
        w, wx, wxx, wy, wxy = self.fit
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        slope = max(0.0, (wxy / w - mx * my) / var) if var > 1e-12 else 0.0
        copies = self.view.copy_s * self.view.excess(k) if self.view is not None else 0.0
        return max(my + slope * (k + 1 - mx), 1e-12) + copies

    def rate(self, k: int) -> float:
        """Expected committed tokens per second of a window of depth K."""
        return self.expected_tokens(self.acceptance(), k) / (k * self.step_s + self.verify_time(k))

    def next_k(self) -> int:
        view = self.view
        if self.step_s is not None and self.fit[0] > 0:
            self.k = max(range(1, self.k_max + 1), key=lambda k: (self.rate(k), -k))
            self.why = (f"K={self.k}: the most expected tokens per second (acceptance "
                        f"{self.acceptance():.2f}, draft step {self.step_s * 1e3:.3g} ms, "
                        f"verification {self.verify_time(self.k) * 1e3:.3g} ms)")
            if view is not None and view.ready:
                self.why += "; " + view.why(self.k)
        elif view is not None and self.accepted + self.rejected == 0:
            if not view.ready:
                view.sample()  # the prefill's routing
            if view.ready:  # before any window: the deepest K within the slots
                self.k = min(self.k0, view.deepest_within_slots(self.k_max))
                self.why = f"K={self.k}: the deepest within the slots: " + view.why(self.k)
        return self.k

    def observe(self, k: int, accepted: int, rejected: int, draft_s: float, draft_steps: int,
                verify_s: float, streamed: float = 0.0) -> None:
        """One window at depth `k`: tokens accepted and rows that rejected one (over the
        batch), the draft's time over its steps, the verification's time, and (with a view)
        the experts its verification streamed beyond the slots, whose copies are taken out of
        the time the line is fitted to."""
        if self.view is not None:
            verify_s = max(verify_s - self.view.copy_s * streamed, 0.0)
        da, dt = self.acceptance_decay, self.time_decay
        self.accepted = da * self.accepted + accepted
        self.rejected = da * self.rejected + rejected
        if draft_steps > 0:
            step = draft_s / draft_steps
            self.step_s = step if self.step_s is None else dt * self.step_s + (1 - dt) * step
        x = k + 1
        self.fit = [dt * v + add for v, add in
                    zip(self.fit, (1.0, x, x * x, verify_s, x * verify_s))]
