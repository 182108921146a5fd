"""Measure of unions and intersections of closed time intervals.

Owns: the interval arithmetic behind the link's H2D-hiding metric (docs/paper-notes.md, "H2D
hiding"): the busy time of the copy engine is the measure of the union of transfer intervals,
the exposed wait is the measure of the union of the compute stream's wait intervals, and the
hidden part of H2D is H2D minus their intersection.
Does not own: where intervals come from (the link records them) or any policy.

Intervals are `(start, end)` pairs of floats with `start <= end`. Touching intervals merge,
zero-length intervals have measure zero and are dropped, nested ones are absorbed.
"""

from __future__ import annotations

Interval = tuple[float, float]


def _check(intervals: list[Interval]) -> None:
    for start, end in intervals:
        if end < start:
            raise ValueError(f"interval ends before it starts: ({start}, {end})")


def merge(intervals: list[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering the same set (zero-length pieces dropped).

    Algorithm: sort by start; sweep, extending the current run while the next interval
    starts at or before the run's end (touching counts as overlapping), else close the run.
    """
    _check(intervals)
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def union_length(intervals: list[Interval]) -> float:
    """Measure of the union of `intervals` (0.0 for an empty list)."""
    return sum(end - start for start, end in merge(intervals))


def intersection_length(a: list[Interval], b: list[Interval]) -> float:
    """Measure of (union of a) intersected with (union of b).

    Algorithm: merge both sides into sorted disjoint runs, then walk them with two pointers;
    each step adds the overlap of the two current runs and advances the one ending first.
    """
    ma, mb = merge(a), merge(b)
    i = j = 0
    total = 0.0
    while i < len(ma) and j < len(mb):
        lo = max(ma[i][0], mb[j][0])
        hi = min(ma[i][1], mb[j][1])
        if hi > lo:
            total += hi - lo
        if ma[i][1] <= mb[j][1]:
            i += 1
        else:
            j += 1
    return total
