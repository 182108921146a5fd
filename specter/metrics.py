"""Per-request timing metrics from commit timestamps (definitions in docs/paper-notes.md).

TPOT = (time of last committed token - time of first committed token) / (N - 1);
TTFT = first commit - request start; tokens/s = N / (last commit - request start).
Pure functions of a `Generation`, so every system is measured the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Generation:
    """One request's result, as every decode loop returns it (decoding/loop.py): what the
    metrics below are functions of."""

    tokens: list[int]  # committed output tokens, prompt excluded
    commit_times_s: list[float]  # clock time at which each token was committed
    start_time_s: float  # clock time the request started (before prefill)
    peak_mem_bytes: int
    peak_mem_source: str  # "cuda_allocator" (measured) | "device_tensors" (measured sum, CPU)
    stats: dict[str, Any] = field(default_factory=dict)  # system-specific record columns


def timing(gen: Generation) -> dict[str, float]:
    n = len(gen.tokens)
    if n == 0:
        raise ValueError("a generation must commit at least one token")
    first, last = gen.commit_times_s[0], gen.commit_times_s[-1]
    e2e = last - gen.start_time_s
    return {
        "n_output_tokens": n,
        "tpot_ms": (last - first) / (n - 1) * 1e3 if n > 1 else math.nan,
        "ttft_ms": (first - gen.start_time_s) * 1e3,
        "e2e_ms": e2e * 1e3,
        "tokens_per_s": n / e2e if e2e > 0 else math.nan,
    }


def distinct_n(tokens: list[int], n: int = 4) -> float:
    """Fraction of distinct n-grams in the output: a repetitiveness check for a reader."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan
