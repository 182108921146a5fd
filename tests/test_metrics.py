"""Metrics arithmetic (specter/metrics.py): TPOT from commit times, distinct-n."""

from __future__ import annotations

import math

import pytest

from specter.decoding.batch import Generation
from specter.metrics import distinct_n, timing


def test_tpot_from_commit_times():
    gen = Generation(tokens=[5, 6, 7, 8], commit_times_s=[1.0, 1.1, 1.2, 1.4], start_time_s=0.5,
                     peak_mem_bytes=1, peak_mem_source="device_tensors")
    t = timing(gen)
    assert t["tpot_ms"] == pytest.approx(400 / 3)
    assert t["ttft_ms"] == pytest.approx(500)
    assert t["tokens_per_s"] == pytest.approx(4 / 0.9)
    one = timing(Generation([5], [1.0], 0.5, 1, "x"))
    assert math.isnan(one["tpot_ms"])


def test_distinct_n():
    assert distinct_n([1, 2, 1, 2, 1, 2], 2) == pytest.approx(2 / 5)
    assert distinct_n([1, 2, 3, 4, 5], 4) == 1.0
