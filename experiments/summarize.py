"""Print a side-by-side table of a results tree: `python -m experiments.summarize OUT_DIR`.

Reads parquet records only. One row per (model, budget, hardware, clock, charged sizes,
system): mean TPOT, hit rate, H2D hidden fraction, exposed wait, and TPOT relative to
`resident` in the same group. Ends with one machine-readable JSON line.
"""

from __future__ import annotations

import json
import sys

import pandas as pd

from experiments import records

KEYS = ["model", "budget", "budget_slots", "hardware", "clock", "charged"]
METRICS = {"tpot_ms": "mean", "hit_rate": "mean", "h2d_hidden_frac": "mean",
           "exposed_wait_ms": "mean", "n_output_tokens": "mean", "distinct_4": "mean"}


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["charged"] = df.get("charged.source", pd.Series("-", index=df.index)).fillna("-")
    for col in METRICS:
        if col not in df:
            df[col] = float("nan")
    out = df.groupby(KEYS + ["system"], dropna=False).agg(METRICS).reset_index()
    out["rows"] = df.groupby(KEYS + ["system"], dropna=False).size().values
    base = out[out["system"] == "resident"].set_index(KEYS)["tpot_ms"]
    out["x_resident"] = [r["tpot_ms"] / base.get(tuple(r[k] for k in KEYS), float("nan"))
                         for _, r in out.iterrows()]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m experiments.summarize OUT_DIR", file=sys.stderr)
        return 2
    df = records.load(argv[0])
    if df.empty:
        print(f"error: no records under {argv[0]}", file=sys.stderr)
        return 2
    t = table(df)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print("SUMMARY " + json.dumps(t.to_dict(orient="records"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
