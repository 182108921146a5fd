"""The layer-aware prefetch planner's rules, as pure functions (docs/paper-notes.md, "PIO").

Three phases per draft window of k steps:
- Cold Start: no plan until `cold_start_steps(k)` draft steps have filled the ELB a little
  (`max(1, int(0.2 k))` as the authors' artifact rounds; `rounding="ceil"`: ceil(0.2 k)).
- Prefetch Overlap: at each boundary, per layer, the top-M experts the draft routed to
  (count >= 1) that are not resident or already planned go out as one H2D batch (M = the
  slots by default, as in the artifact); the next boundary is set so that the next draft
  chunk computes about as long as that batch takes to move (`next_chunk_steps`, from running
  averages of bandwidth and draft-step time).
- Final Cleanup: lookahead stops once every layer's plan fills its slots (`plan_full`), or
  the window ends: no plan after the last draft step (the artifact), or, as an option, one
  last plan with the whole window's counts; verification then waits for the last batch to
  land (the artifact) or per expert on what is still in flight (an option).
A layer's plan is the set of experts it holds for the coming verification: predicted experts
already resident (held, free) and those loaded for it, at most `slots`.
Nothing here touches a tensor, a cache or a clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence


ROUNDINGS = ("floor", "ceil")


def cold_start_steps(k: int, fraction: float = 0.2, rounding: str = "floor") -> int:
    """Draft steps before the first plan: about `fraction` of the window, at least one;
    "floor": max(1, int(fraction * k)) (the artifact's), "ceil": max(1, ceil(fraction * k))."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS} (got {rounding!r})")
    steps = int(fraction * k) if rounding == "floor" else math.ceil(fraction * k)
    return min(k, max(1, steps))


def next_chunk_steps(batch_s: float, step_s: float) -> int:
    """Draft steps whose compute covers a batch of `batch_s` seconds of transfers."""
    if batch_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(batch_s / step_s))


@dataclass
class LayerBatch:
    """One boundary's decision for one layer."""

    hold: list[int] = field(default_factory=list)  # predicted and already resident
    load: list[int] = field(default_factory=list)  # predicted, to be copied now


def rank(counts: Sequence[int]) -> list[int]:
    """Experts with count >= 1, most counted first (ties: lower id first)."""
    return sorted((e for e, c in enumerate(counts) if c >= 1), key=lambda e: (-counts[e], e))


def plan_layer(counts: Sequence[int], resident: set[int], planned: set[int], slots: int,
               top_m: int) -> LayerBatch:
    """Walk the ranked predictions: resident ones join the plan as holds, absent ones as loads
    (at most `top_m` loads), until the plan holds `slots` experts."""
    batch = LayerBatch()
    size = len(planned)
    for e in rank(counts):
        if size >= slots or len(batch.load) >= top_m:
            break
        if e in planned:
            continue
        (batch.hold if e in resident else batch.load).append(e)
        size += 1
    return batch


def plan_batch(counts: Sequence[Sequence[int]], resident: Sequence[set[int]],
               planned: Sequence[set[int]], slots: int, top_m: int) -> list[LayerBatch]:
    """`plan_layer` for every MoE layer, layer order (the order verification needs them)."""
    return [plan_layer(c, r, p, slots, top_m) for c, r, p in zip(counts, resident, planned)]


def plan_full(planned: Sequence[set[int]], slots: int) -> bool:
    """Every layer's plan holds its slots: nothing more can be prefetched this window."""
    return all(len(p) >= slots for p in planned)


def batch_seconds(n_loads: int, expert_bytes: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Transfer time of a batch of `n_loads` expert copies on one copy engine."""
    return n_loads * (expert_bytes / bandwidth_Bps + latency_s)


def corrupt(batch: list[LayerBatch], counts: Sequence[Sequence[int]], resident: Sequence[set[int]],
            share: float, rng: random.Random) -> int:
    """The oracle experiment: replace each planned load, with probability `share`, by an
    expert the draft did not route to and that is not resident (a wrong prediction). Returns
    how many were replaced."""
    replaced = 0
    if share <= 0:
        return 0
    for l, b in enumerate(batch):
        taken = set(b.load)
        wrong = [e for e, c in enumerate(counts[l]) if c == 0 and e not in resident[l]]
        for i, e in enumerate(b.load):
            choices = [w for w in wrong if w not in taken]
            if choices and rng.random() < share:
                b.load[i] = rng.choice(choices)
                taken.add(b.load[i])
                replaced += 1
    return replaced


class RunningMean:
    """Exponential moving average with a prior. `blend=False`: the prior stands until the
    first measurement replaces it; `blend=True` (the artifact's): the prior is the average's
    starting value, each measurement moves it by `weight`."""

    def __init__(self, prior: float, weight: float = 0.25, blend: bool = False):
        self.value, self.weight, self.samples, self.blend = prior, weight, 0, blend

    def update(self, x: float) -> None:
        if x > 0 and math.isfinite(x):
            first = self.samples == 0 and not self.blend
            self.value = x if first else (1 - self.weight) * self.value + self.weight * x
            self.samples += 1
