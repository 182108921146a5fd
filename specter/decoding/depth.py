"""The draft depth K: the one rule every speculative system follows (`settle_depth`), and
the per-window depth of `spec.k=adaptive` (`AdaptiveDepth`).

The rule: `spec.k=N` -> N; `spec.k=auto` -> the profiled K (`depth_profile.py`, run by the
harness on the built engine), except for a system with its own K, which keeps it (a baseline
runs at the depth its paper or artifact uses) unless `spec.tune_own_k=true` (a tuned-depth
baseline, reported as its own variant); `spec.k=adaptive` -> a K per window (`AdaptiveDepth`,
starting from the unset rule's K, at most `spec.k_max`); unset -> the system's own K if its
recipe has one (`OWN_K`: SpecMoEOff 3, SpecMoE 4, as their papers run them), else the model's
paper K (`model.paper_k`), else DEFAULT_K. Every record says which one applied (`k_source`).
The rule has one caller, `experiments/registry.py depth_of` (the recipe's `OWN_K` read there):
the build context settles it once and the engine is built with that `Depth`; the runner's
context check, before the weights load, asks `depth_of` for the deepest window (`k_max`).
Does not own: the engine (systems), the profiler (depth_profile.py), timing.
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

    def policy(self) -> AdaptiveDepth | None:
        """A fresh per-window depth for `adaptive`, else None (every window at `k`)."""
        return AdaptiveDepth(self.k, self.k_max) if self.mode == "adaptive" else None


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
    the rule changes speed only. Time is the run's clock (virtual: the cost model's)."""

    def __init__(self, k0: int, k_max: int, acceptance_decay: float = 0.95,
                 time_decay: float = 0.8):
        if not 1 <= k0 <= k_max:
            raise ValueError(f"starting K {k0} must lie in 1..{k_max}")
        self.k0, self.k_max = k0, k_max
        self.acceptance_decay, self.time_decay = acceptance_decay, time_decay
        self.reset()

    def reset(self) -> None:
        """Before each request: the starting K and no measurements."""
        self.k = self.k0
        self.accepted = self.rejected = 0.0
        self.step_s: float | None = None
        self.fit = [0.0] * 5  # decayed sums of w, w x, w x^2, w y, w x y; x = K + 1, y = seconds

    def acceptance(self) -> float:
        return (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def verify_time(self, k: int) -> float:
        """The fitted verification time of a window of depth K."""
        w, wx, wxx, wy, wxy = self.fit
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        slope = max(0.0, (wxy / w - mx * my) / var) if var > 1e-12 else 0.0
        return max(my + slope * (k + 1 - mx), 1e-12)

    def rate(self, k: int) -> float:
        """Expected committed tokens per second of a window of depth K."""
        return self.expected_tokens(self.acceptance(), k) / (k * self.step_s + self.verify_time(k))

    def next_k(self) -> int:
        if self.step_s is not None and self.fit[0] > 0:
            self.k = max(range(1, self.k_max + 1), key=lambda k: (self.rate(k), -k))
        return self.k

    def observe(self, k: int, accepted: int, rejected: int, draft_s: float, draft_steps: int,
                verify_s: float) -> None:
        """One window at depth `k`: tokens accepted and rows that rejected one (over the
        batch), the draft's time over its steps, the verification's time."""
        da, dt = self.acceptance_decay, self.time_decay
        self.accepted = da * self.accepted + accepted
        self.rejected = da * self.rejected + rejected
        if draft_steps > 0:
            step = draft_s / draft_steps
            self.step_s = step if self.step_s is None else dt * self.step_s + (1 - dt) * step
        x = k + 1
        self.fit = [dt * v + add for v, add in
                    zip(self.fit, (1.0, x, x * x, verify_s, x * verify_s))]
