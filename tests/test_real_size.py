"""The real-size stage's verdict (experiments/real_size.py): a load-time device peak above its
budget fails the stage, and the error table pairs real CUDA time with the virtual clock."""

from __future__ import annotations

import math

import pandas as pd

from experiments import real_size

GiB = 2**30


def _rows() -> pd.DataFrame:
    rows = []
    for system, gb, peak in (("lru", 16.0, 9 * GiB), ("specter", 16.0, 17 * GiB),
                             ("resident", math.nan, 30 * GiB)):
        for clock, hw, tpot in (("wall", "cuda", 50.0), ("virtual", "h200_measured", 40.0),
                                ("virtual", "a100_pcie4_hf", 400.0)):
            rows.append({"system": system, "budget_gb": gb, "clock": clock, "hardware": hw,
                         "tpot_ms": tpot, "load_peak_device_bytes": peak,
                         "load_peak_device_source": "cuda_allocator", "load_s": 3.0})
    return pd.DataFrame(rows)


def test_a_peak_over_its_budget_fails_and_the_error_table_pairs_the_clocks():
    p = real_size.peaks(_rows())
    assert set(p["system"]) == {"lru", "specter"}  # resident holds everything: no budget
    assert dict(zip(p["system"], p["fits"])) == {"lru": True, "specter": False}
    t = real_size.error_table(_rows()).set_index("system")
    assert t.loc["lru", "real_ms"] == 50.0 and t.loc["lru", "virtual_ms"] == 40.0  # not a100's
    assert t.loc["resident", "budget_key"] == "full"
    assert t.loc["specter", "virtual_over_real"] == 0.8
