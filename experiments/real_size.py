"""The real-size check's verdict, computed on any machine from the records the stage wrote
(scripts/real_size.sh, run by scripts/gpu_check.sh stage `real_size`): DeepSeek-V2-Lite at full
depth with random weights (`model.weights=random`), run on a GPU in real CUDA time
(`hardware=cuda`: its rows have clock "cuda") and on the virtual clock of the H200 profile fit
at real size (`hardware=h200_realsize`, clock "virtual"; experiments/clock_check.py), at a
device budget in GiB.

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

3. the stage table (`stage_table`): per (system, budget) on the real side, the slots per
   layer, mean TPOT over every request and over all but each job's first (which pays one-off
   costs), hit rate, hidden H2D fraction, acceptance, the bytes that crossed the link per
   committed token and the link floor they set at the measured H2D rate (`--h2d-gbps`): a
   request's time per committed token (e2e: its bytes include its prefill's) can go no lower
   than that floor, so e2e / floor says how far the engine is from the link;
   each offloading system's TPOT over LRU's at the same budget; with `--hotpath` (an
   experiments.hotpath csv of the same model) launches and syncs per committed token; with
   `--source-records` (the project-made model the inflated one grew from, run as specter on
   the same prompts) its acceptance beside the inflated model's.

    python -m experiments.real_size RECORDS_DIR [--csv OUT] [--virtual-hardware NAME|none]
                                    [--real-hardware NAME] [--h2d-gbps R] [--hotpath CSV]
                                    [--source-records DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

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


def error_table(df: pd.DataFrame, virtual_hardware: str = "h200_realsize",
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


def engine_of(rows: pd.DataFrame) -> dict[str, str]:
    """What a system's rows ran on (issue 45 item 6: one engine, so a ratio measures the
    policy): `experts` the kernel its verification or decode computed experts with
    (offload/grouped.py: fused, grouped_mm, padded, loop; `resident`: HF's own modules), `step` its
    draft's or decode's step (captured: one CUDA graph replay; compiled; eager)."""
    def first(col: str):
        vals = rows[col].dropna() if col in rows else []
        return vals.iloc[0] if len(vals) else None

    experts = first("experts_kernel") or "resident"
    for kind in ("draft", "decode"):
        if first(f"{kind}_compile") is not None:
            how = ("captured" if first(f"{kind}_captured") else
                   "compiled" if first(f"{kind}_compiled") else "eager")
            return {"experts": experts, "step": f"{kind} {how}"}
    return {"experts": experts, "step": "eager"}


def stage_table(df: pd.DataFrame, real_hardware: str | None = None,
                h2d_gbps: float | None = None, hotpath: pd.DataFrame | None = None) -> pd.DataFrame:
    """One line per (system, budget) of the real side: what the GPU stage prints (module doc,
    item 3)."""
    real = (df["hardware"] == real_hardware) if real_hardware else df["clock"].isin(REAL_CLOCKS)
    rows = df[real].assign(budget_key=df.loc[real, "budget_gb"].map(_budget_key))
    rows = rows.assign(tokens=rows["n_output_tokens"].clip(lower=1))
    if "k_source" in rows:  # K chosen per window (spec.k=adaptive): a row of its own
        adaptive = rows["k_source"].astype(str).str.startswith("adaptive")
        rows.loc[adaptive, "system"] = rows.loc[adaptive, "system"] + " K=adaptive"

    def one(g: pd.DataFrame) -> pd.Series:
        later = g.sort_values("request_id")
        later = later.iloc[1:] if len(later) > 1 else later
        tokens = g["tokens"].sum()
        h2d = g["h2d_bytes"].sum() / tokens if "h2d_bytes" in g else math.nan
        out = {"slots": g["budget_slots"].iloc[0], "requests": len(g),
               "tpot_ms": g["tpot_ms"].mean(), "tpot_ms_after_first": later["tpot_ms"].mean(),
               "hit_rate": g["hit_rate"].mean() if "hit_rate" in g else math.nan,
               "h2d_hidden": g["h2d_hidden_frac"].mean() if "h2d_hidden_frac" in g else math.nan,
               "acceptance": g["acceptance_rate"].mean() if "acceptance_rate" in g else math.nan,
               "k_mean": g["k_window_mean"].mean() if "k_window_mean" in g else math.nan,
               "h2d_MB_per_token": h2d / 1e6}
        # the request's bytes include its prefill's: the floor is set against the request's
        # whole time per committed token (e2e), not TPOT (which leaves the prefill out)
        out["e2e_ms_per_token"] = g["e2e_ms"].sum() / tokens if "e2e_ms" in g else math.nan
        out["link_floor_ms"] = h2d / (h2d_gbps * 1e9) * 1e3 if h2d_gbps else math.nan
        out["e2e_over_floor"] = out["e2e_ms_per_token"] / out["link_floor_ms"] \
            if out["link_floor_ms"] else math.nan
        out.update(engine_of(g))
        return pd.Series(out)

    table = rows.groupby(["system", "budget_key"]).apply(one, include_groups=False).reset_index()
    lru = table[table["system"] == "lru"].set_index("budget_key")["tpot_ms"]
    table["over_lru"] = [t / lru.get(b, math.nan) for t, b in
                         zip(table["tpot_ms"], table["budget_key"])]
    if hotpath is not None and len(hotpath):
        total = hotpath[hotpath["phase"].str.startswith("decoding")].set_index("system")
        table["launches_per_token"] = table["system"].map(total["launching_per_token"])
        # the host's time per launch where the host bounds decoding (issue 46: the per-operation
        # rate at real size, measured on each GPU run; docs/measurements/clock-vs-h200-2026-12-05.md)
        table["us_per_launch"] = table["tpot_ms_after_first"] * 1e3 / table["launches_per_token"]
        table["syncs_per_token"] = table["system"].map(total["syncs_per_token"])
        if "host_reads_per_token" in total:
            table["reads_per_token"] = table["system"].map(total["host_reads_per_token"])
        if "experts_calls" in hotpath:  # launches per MoE layer call, copies apart
            moe = hotpath[~hotpath["phase"].isin(["prefill"])
                          & ~hotpath["phase"].str.startswith("decoding")].groupby("system")
            per = moe["experts_launching"].sum() / moe["experts_calls"].sum().replace(0, math.nan)
            table["launches_per_moe_layer"] = table["system"].map(per)
    return table.sort_values(["budget_key", "system"], ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    from experiments import records

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records")
    ap.add_argument("--csv", help="write the error table here too")
    ap.add_argument("--virtual-hardware", default="h200_realsize",
                    help="the virtual side's hardware profile (default: h200_realsize)")
    ap.add_argument("--real-hardware", default=None,
                    help="the real side's hardware name, whatever its clock (default: every "
                         "row on a real clock, cuda or wall)")
    ap.add_argument("--h2d-gbps", type=float, default=None,
                    help="the measured H2D rate in GB/s: the link floor per committed token")
    ap.add_argument("--hotpath", default=None, help="an experiments.hotpath csv: launches and "
                    "syncs per committed token beside each system")
    ap.add_argument("--source-records", default=None, help="records of the project-made model "
                    "the inflated one grew from, run as specter on the same prompts")
    args = ap.parse_args(argv)
    df = records.load(args.records)
    if df.empty:
        print(f"error: no rows under {args.records}", file=sys.stderr)
        return 2
    p = peaks(df)
    table = error_table(df, args.virtual_hardware, args.real_hardware)
    hot = pd.read_csv(args.hotpath) if args.hotpath and Path(args.hotpath).is_file() else None
    stage = stage_table(df, args.real_hardware, args.h2d_gbps, hot)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print("load-time device peak against the budget (offloading systems):")
        print(p.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if args.virtual_hardware != "none":
            print(f"\nTPOT, the real side beside the virtual clock of {args.virtual_hardware} "
                  "(same sizes):")
            print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        weights = ",".join(sorted(set(df["weights"].dropna()))) if "weights" in df else "?"
        print(f"\nthe real side ({weights} weights; link floor at "
              f"{args.h2d_gbps or float('nan'):.1f} GB/s):")
        print(stage.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if args.source_records:
            src = records.load(args.source_records)
            if len(src) and "acceptance_rate" in src:
                spec = df[(df["system"] == "specter") & df["clock"].isin(REAL_CLOCKS)]
                print(f"\nacceptance: inflated {spec['acceptance_rate'].mean():.3f} (specter, "
                      f"every budget), its source {src['model'].iloc[0]} "
                      f"{src['acceptance_rate'].mean():.3f} on the same prompts")
    if args.csv:
        table.to_csv(args.csv, index=False)
        stage.to_csv(str(args.csv).replace(".csv", "") + "_stage.csv", index=False)
    bad = p[~p["fits"]]
    if len(bad):
        print(f"FAIL: {len(bad)} load-time device peak(s) exceed their budget", file=sys.stderr)
        return 1
    if args.virtual_hardware == "none":
        if stage.empty:
            print("FAIL: no rows on the real side", file=sys.stderr)
            return 1
        return 0
    if table["real_ms"].isna().all() or table["virtual_ms"].isna().all():
        print("FAIL: the error table pairs no rows (no real-clock rows, or none of "
              f"hardware={args.virtual_hardware} on the virtual clock)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
