"""The paper's figures and tables from parquet records: `python -m experiments.plots ROOT`.

Each module defines `RESULTS = [Result(...), ...]` (base.py); this package collects them in
`RESULTS`, in the order below. `kernel` (the INT4 kernel microbenchmark) is collected when its
module exists.
"""

from __future__ import annotations

import importlib
from pathlib import Path

MODULES = ("main_tpot", "memory", "cache", "ablation", "latency", "fidelity", "working_set",
           "depth", "oracle", "kernel")
OPTIONAL = ("kernel",)


def _collect() -> list:
    here = Path(__file__).resolve().parent
    out = []
    for name in MODULES:
        if name in OPTIONAL and not (here / f"{name}.py").exists():
            continue
        out.extend(importlib.import_module(f"{__name__}.{name}").RESULTS)
    return out


RESULTS = _collect()
