"""The real-size check's verdict, computed on any machine from the records the stage wrote
(scripts/real_size.sh, run by scripts/gpu_check.sh stage `real_size`): DeepSeek-V2-Lite at full
depth with random weights (`model.weights=random`), run on a GPU in real CUDA time
(`hardware=cuda`: its rows have clock "cuda") and on the virtual clock of the measured H200
profile (`hardware=h200_measured`, clock "virtual"), at a device budget in GiB.

Reads the records and prints:
1. the load-time device peak of every offloading row (`load_peak_device_bytes`: the CUDA
   allocator's peak from before loading to the first request; on the CPU the bytes the loader
   placed) against its budget's GiB, with what the device already held when the job began
   (`load_base_device_bytes`, CUDA only: 0 when the runner freed the job before); the check
   fails (exit 1) when a peak exceeds its budget;
2. the error table: per (system, budget) the mean TPOT of the real side beside the virtual
   clock's at the same sizes, and their ratio (virtual / real). The real side is every row on
   a real clock ("cuda"; "wall" for a CPU wall-clock run), or, with --real-hardware NAME, that
   hardware's rows whatever their clock (a CPU dry run of the stage has no real clock for an
   offloading system: a virtual profile stands in, and `real_clock` says so).

    python -m experiments.real_size RECORDS_DIR [--csv OUT] [--virtual-hardware NAME]
                                    [--real-hardware NAME]
"""

from __future__ import annotations

import argparse
import math
import sys

import pandas as pd

GiB = 2**30
REAL_CLOCKS = ("cuda", "wall")  # measured time (the CUDA link's events; perf_counter)


def peaks(df: pd.DataFrame) -> pd.DataFrame:
    """One line per (system, budget, hardware, clock) of the offloading rows: the load-time
    device peak, the budget, and whether it fits."""
    rows = df[df["budget_gb"].notna() & (df["system"] != "resident")]
    if "load_base_device_bytes" not in rows.columns:  # records from before the column
        rows = rows.assign(load_base_device_bytes=math.nan)
    out = (rows.groupby(["system", "budget_gb", "hardware", "clock"], as_index=False)
           .agg(load_peak_gib=("load_peak_device_bytes", lambda s: s.max() / GiB),
                held_before_gib=("load_base_device_bytes", lambda s: s.max() / GiB),
                source=("load_peak_device_source", "first"), load_s=("load_s", "max")))
    out["fits"] = out["load_peak_gib"] <= out["budget_gb"]
    return out


def _budget_key(g: float) -> str:
    return "full" if math.isnan(g) else f"{g:g} GiB"


def error_table(df: pd.DataFrame, virtual_hardware: str = "h200_measured",
                real_hardware: str | None = None) -> pd.DataFrame:
    """Mean TPOT per (system, budget): the real side (rows on a real clock, REAL_CLOCKS; with
    `real_hardware`, that hardware's rows whatever their clock) beside the virtual clock of
    `virtual_hardware`; `real_clock` names the real side's clock(s). A pair missing a side
    has NaN there."""
    virtual = (df["clock"] == "virtual") & (df["hardware"] == virtual_hardware)
    real = (df["hardware"] == real_hardware) if real_hardware else df["clock"].isin(REAL_CLOCKS)
    real &= ~virtual
    key = ["system", "budget_key"]

    def side(rows: pd.DataFrame, name: str) -> pd.DataFrame:
        rows = rows.assign(budget_key=rows["budget_gb"].map(_budget_key))
        return (rows.groupby(key, as_index=False)
                .agg(**{f"{name}_ms": ("tpot_ms", "mean"), f"{name}_rows": ("tpot_ms", "size"),
                        f"{name}_hardware": ("hardware", lambda s: ",".join(sorted(set(s)))),
                        f"{name}_clock": ("clock", lambda s: ",".join(sorted(set(s))))}))

    table = side(df[real], "real").merge(side(df[virtual], "virtual"), on=key, how="outer")
    table = table.drop(columns=["virtual_clock"])
    table["virtual_over_real"] = table["virtual_ms"] / table["real_ms"]
    return table.sort_values(key, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    from experiments import records

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records")
    ap.add_argument("--csv", help="write the error table here too")
    ap.add_argument("--virtual-hardware", default="h200_measured",
                    help="the virtual side's hardware profile (default: h200_measured)")
    ap.add_argument("--real-hardware", default=None,
                    help="the real side's hardware name, whatever its clock (default: every "
                         "row on a real clock, cuda or wall)")
    args = ap.parse_args(argv)
    df = records.load(args.records)
    if df.empty:
        print(f"error: no rows under {args.records}", file=sys.stderr)
        return 2
    p = peaks(df)
    table = error_table(df, args.virtual_hardware, args.real_hardware)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print("load-time device peak against the budget (offloading systems):")
        print(p.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print(f"\nTPOT, the real side beside the virtual clock of {args.virtual_hardware} "
              "(same sizes):")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.csv:
        table.to_csv(args.csv, index=False)
    bad = p[~p["fits"]]
    if len(bad):
        print(f"FAIL: {len(bad)} load-time device peak(s) exceed their budget", file=sys.stderr)
        return 1
    if table["real_ms"].isna().all() or table["virtual_ms"].isna().all():
        print("FAIL: the error table pairs no rows (no real-clock rows, or none of "
              f"hardware={args.virtual_hardware} on the virtual clock)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
