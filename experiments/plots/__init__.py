"""The paper's figures and tables from parquet records: `python -m experiments.plots ROOT`.

Each module defines `RESULTS = [Result(...), ...]` (base.py); this package collects them in
`RESULTS`, in the order below.
"""

from __future__ import annotations

import importlib

MODULES = ("main_tpot", "memory", "cache", "ablation", "latency", "fidelity", "routing",
           "working_set", "depth", "oracle", "kernel", "batch", "hybrid", "crossover", "anchors")


def _collect() -> list:
    out = []
    for name in MODULES:
        out.extend(importlib.import_module(f"{__name__}.{name}").RESULTS)
    return out


RESULTS = _collect()
