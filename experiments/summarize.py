"""Print a side-by-side table of a results tree: `python -m experiments.summarize OUT_DIR [--short]`.

Reads parquet records only. One row per (model, budget, hardware, clock, charged sizes,
system): mean TPOT, K and acceptance, hit rate (per expert per layer-forward, and per
(token, expert) request), H2D hidden fraction, exposed wait, TPOT relative to `resident` and
speedup over `specmoeoff` in the same group. Ends with one machine-readable JSON line.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import fields

import pandas as pd

from experiments import records
from experiments.registry import config_class

KEYS = ["model", "budget", "budget_slots", "hardware", "clock", "charged"]
METRICS = {"tpot_ms": "mean", "k": "mean", "acceptance_rate": "mean", "hit_rate": "mean",
           "hit_rate_cap": "mean",
           "hit_rate_tokens": "mean", "prefetch_precision": "mean", "h2d_ms": "mean",
           "exposed_wait_ms": "mean", "h2d_hidden_frac": "mean",
           "distinct_experts_per_forward": "mean", "n_output_tokens": "mean", "distinct_4": "mean"}


def variant(row: pd.Series) -> str:
    """What sets a run apart from its system's defaults: system knobs and a fixed spec.k."""
    cls = config_class(str(row.get("system")))
    defaults = cls(name="-")
    parts = [f"{f.name}={row[f'cfg.system.{f.name}']}" for f in fields(cls)
             if f.name != "name" and f"cfg.system.{f.name}" in row
             and not _same(row[f"cfg.system.{f.name}"], getattr(defaults, f.name))]
    staging = row.get("budget_staging")
    if isinstance(staging, (int, float)) and not math.isnan(staging) and staging > 0:
        parts.append(f"staging={int(staging)}")
    k = row.get("cfg.spec.k")
    if k is not None and not (isinstance(k, float) and math.isnan(k)):
        parts.append(f"k={k}")
    return ",".join(parts) or "-"


def _same(value, default) -> bool:
    """Equal to the default; a missing value (records older than the knob) counts as it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    return value == default


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["charged"] = df.get("charged.source", pd.Series("-", index=df.index)).fillna("-")
    df["variant"] = df.apply(variant, axis=1)
    for col in METRICS:
        if col not in df:
            df[col] = float("nan")
    out = df.groupby(KEYS + ["system", "variant"], dropna=False).agg(METRICS).reset_index()
    out["rows"] = df.groupby(KEYS + ["system", "variant"], dropna=False).size().values
    base = out[out["system"] == "resident"].groupby(KEYS)["tpot_ms"].first()
    out["x_resident"] = [r["tpot_ms"] / base.get(tuple(r[k] for k in KEYS), float("nan"))
                         for _, r in out.iterrows()]
    smo = out[(out["system"] == "specmoeoff") & (out["variant"] == "-")].groupby(KEYS)["tpot_ms"].first()
    out["speedup_vs_specmoeoff"] = [smo.get(tuple(r[k] for k in KEYS), float("nan")) / r["tpot_ms"]
                                    for _, r in out.iterrows()]
    return out


SHORT = {"system": "system", "variant": "variant", "tpot_ms": "TPOT ms", "x_resident": "x resident",
         "speedup_vs_specmoeoff": "speedup vs SpecMoEOff", "hit_rate": "hit rate",
         "hit_rate_cap": "hit-rate cap", "h2d_hidden_frac": "H2D hidden", "acceptance_rate": "acceptance"}


def short(df: pd.DataFrame) -> str:
    """The main job's table: one block per case (model, budget, clock, profile), fastest first."""
    t = table(df)
    engine = df.get("engine", pd.Series("-", index=df.index)).fillna("-")
    eng = dict(zip(df["hardware"], engine))
    out = []
    for key, g in t.groupby(KEYS, dropna=False, sort=True):
        case = dict(zip(KEYS, key))
        out.append(f"model={case['model']} budget={case['budget']} ({case['budget_slots']} slots/layer), "
                   f"{case['clock']} clock, profile {case['hardware']} ({eng.get(case['hardware'], '-')} "
                   f"engine), sizes charged: {case['charged']}")
        g = g.sort_values("tpot_ms")[list(SHORT)].rename(columns=SHORT)
        out.append(g.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3g}"))
        out.append("")
    out.append("hit-rate cap: the most a slot-limited per-layer demand hit rate can reach, "
               "sum(min(slots + staging buffers, experts needed)) / experts needed over verify forwards.")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    brief = "--short" in argv
    argv = [a for a in argv if a != "--short"]
    if len(argv) != 1:
        print("usage: python -m experiments.summarize OUT_DIR [--short]", file=sys.stderr)
        return 2
    df = records.load(argv[0])
    if df.empty:
        print(f"error: no records under {argv[0]}", file=sys.stderr)
        return 2
    if brief:
        print(short(df))
        return 0
    t = table(df)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print("SUMMARY " + json.dumps(t.to_dict(orient="records"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
