"""The real-size check's verdict (scripts/gpu_check.sh, stage `real_size`): DeepSeek-V2-Lite at
full depth with random weights (`model.weights=random`), run on a GPU in real CUDA time and on
the virtual clock of the measured H200 profile, at device budgets in GiB.

Reads the stage's records and prints:
1. the load-time device peak of every offloading row (`load_peak_device_bytes`: the CUDA
   allocator's peak from before loading to the first request) against its budget's GiB; the
   check fails (exit 1) when a peak exceeds its budget;
2. the error table: per (system, budget) the mean TPOT in real CUDA time beside the virtual
   clock's at the same sizes, and their ratio (virtual / real).

    python -m experiments.real_size RECORDS_DIR [--csv OUT]
"""

from __future__ import annotations

import argparse
import math
import sys

import pandas as pd

GiB = 2**30


def peaks(df: pd.DataFrame) -> pd.DataFrame:
    """One line per (system, budget) of the offloading rows: peak, budget, and whether it fits."""
    rows = df[df["budget_gb"].notna() & (df["system"] != "resident")]
    out = (rows.groupby(["system", "budget_gb", "clock"], as_index=False)
           .agg(load_peak_gib=("load_peak_device_bytes", lambda s: s.max() / GiB),
                source=("load_peak_device_source", "first"), load_s=("load_s", "max")))
    out["fits"] = out["load_peak_gib"] <= out["budget_gb"]
    return out


def error_table(df: pd.DataFrame, virtual_hardware: str = "h200_measured") -> pd.DataFrame:
    """Mean TPOT per (system, budget): real CUDA time (clock=wall) beside the virtual clock of
    `virtual_hardware`."""
    df = df[(df["clock"] == "wall") | ((df["clock"] == "virtual")
                                       & (df["hardware"] == virtual_hardware))]
    df = df.assign(budget_key=df["budget_gb"].map(lambda g: "full" if math.isnan(g) else f"{g:g} GiB"))
    mean = df.groupby(["system", "budget_key", "clock"])["tpot_ms"].mean().unstack("clock")
    table = pd.DataFrame({"real_ms": mean.get("wall"), "virtual_ms": mean.get("virtual")})
    table["virtual_over_real"] = table["virtual_ms"] / table["real_ms"]
    return table.reset_index()


def main(argv: list[str] | None = None) -> int:
    from experiments import records

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records")
    ap.add_argument("--csv", help="write the error table here too")
    args = ap.parse_args(argv)
    df = records.load(args.records)
    if df.empty:
        print(f"error: no rows under {args.records}", file=sys.stderr)
        return 2
    p = peaks(df)
    table = error_table(df)
    with pd.option_context("display.width", 200):
        print("load-time device peak against the budget (offloading systems):")
        print(p.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print("\nTPOT, real CUDA time beside the virtual clock (same sizes):")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.csv:
        table.to_csv(args.csv, index=False)
    bad = p[~p["fits"]]
    if len(bad):
        print(f"FAIL: {len(bad)} load-time device peak(s) exceed their budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
