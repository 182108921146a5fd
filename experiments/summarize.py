"""Print a side-by-side table of a results tree: `python -m experiments.summarize OUT_DIR
[--short | --agreement]` (`--agreement`: output tokens differing from resident's).

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
from specter.config import system_config_class

KEYS = ["model", "budget", "budget_slots", "hardware", "clock", "charged"]
METRICS = {"tpot_ms": "mean", "k": "mean", "acceptance_rate": "mean", "hit_rate": "mean",
           "hit_rate_cap": "mean",
           "hit_rate_tokens": "mean", "prefetch_precision": "mean", "h2d_ms": "mean",
           "exposed_wait_ms": "mean", "h2d_hidden_frac": "mean",
           "distinct_experts_per_forward": "mean", "n_output_tokens": "mean", "distinct_4": "mean"}


def variant(row: pd.Series) -> str:
    """What sets a run apart from its system's defaults: system knobs and a fixed spec.k."""
    cls = system_config_class(str(row.get("system")))
    defaults = cls(name=str(row.get("system")))
    parts = [f"{f.name}={row[f'cfg.system.{f.name}']}" for f in fields(cls)
             if f.name != "name" and f"cfg.system.{f.name}" in row
             and not _same(row[f"cfg.system.{f.name}"], _default(defaults, f.name))]
    staging = row.get("budget_staging")
    if isinstance(staging, (int, float)) and not math.isnan(staging) and staging > 0:
        parts.append(f"staging={int(staging)}")
    k = row.get("cfg.spec.k")
    if k is not None and not (isinstance(k, float) and math.isnan(k)):
        parts.append(f"k={k}")
    return ",".join(parts) or "-"


def _default(defaults, knob: str):
    """A knob's default for this system (host_compute's None means "by the system's name")."""
    if knob == "host_compute":
        from specter.specter_recipe import host_compute_on

        return host_compute_on(defaults)
    return getattr(defaults, knob)


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


def weights_line(df: pd.DataFrame) -> str:
    """Which weights a project-made model's rows decoded: the shipped reference build or a
    local one, with the weights' checksum and the CPU that trained them ("" for real ones)."""
    if "model.origin" not in df:
        return ""
    seen = df[["model.origin", "model.weights_sha256", "model.built_on"]].dropna().drop_duplicates()
    return "\n".join(f"weights: {'shipped reference build' if o == 'reference' else 'local build'}"
                     f" {sha}, trained on {cpu}" for o, sha, cpu in seen.itertuples(index=False))


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
        weights = weights_line(df[df["model"] == case["model"]])
        if weights:
            out.append(weights)
        g = g.sort_values("tpot_ms")[list(SHORT)].rename(columns=SHORT)
        out.append(g.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.3g}"))
        out.append("")
    out.append("hit-rate cap: the most a slot-limited per-layer demand hit rate can reach, "
               "sum(min(slots + staging buffers, experts needed)) / experts needed over verify forwards.")
    return "\n".join(out)


def agreement(df: pd.DataFrame, reference: str = "resident") -> pd.DataFrame:
    """Per (case, system): how many output tokens differ from `reference`'s on the same
    (request, repeat): position by position, plus any length difference. Lossless systems
    show 0; host-computed misses beside a GPU (fp32 on the host) may not."""
    group = [k for k in KEYS if k not in ("budget", "budget_slots")] + ["dataset", "batch_size"]
    group = [k for k in group if k in df]
    df = df.assign(**{k: df[k].fillna("-") for k in group})
    ref = {(tuple(r[k] for k in group), r["request_id"], r["repeat"]): list(r["output_tokens"])
           for _, r in df[df["system"] == reference].iterrows()}
    rows = []
    for _, r in df[df["system"] != reference].iterrows():
        want = ref.get((tuple(r[k] for k in group), r["request_id"], r["repeat"]))
        if want is None:
            continue
        got = list(r["output_tokens"])
        differ = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                     None if len(got) == len(want) else min(len(got), len(want)))
        rows.append({**{k: r[k] for k in group}, "budget": r.get("budget"), "system": r["system"],
                     "rows": 1, "identical_rows": int(differ == 0), "tokens": len(want),
                     "tokens_differing": differ, "first_divergence": first,
                     "host_experts": r.get("host_experts", math.nan)})
    if not rows:
        return pd.DataFrame()
    out = pd.DataFrame(rows)
    keys = group + ["budget", "system"]
    return out.groupby(keys, dropna=False).agg(
        rows=("rows", "sum"), identical_rows=("identical_rows", "sum"), tokens=("tokens", "sum"),
        tokens_differing=("tokens_differing", "sum"), earliest_divergence=("first_divergence", "min"),
        host_experts=("host_experts", "sum")).reset_index()


USAGE = "usage: python -m experiments.summarize OUT_DIR [--short | --agreement]"


def main(argv: list[str]) -> int:
    flags = {a for a in argv if a.startswith("--")}
    argv = [a for a in argv if not a.startswith("--")]
    if len(argv) != 1 or flags - {"--short", "--agreement"} or len(flags) > 1:
        print(USAGE, file=sys.stderr)
        return 2
    df = records.load(argv[0])
    if df.empty:
        print(f"error: no records under {argv[0]}", file=sys.stderr)
        return 2
    if "--short" in flags:
        print(short(df))
        return 0
    if "--agreement" in flags:
        a = agreement(df)
        if a.empty:
            print(f"error: no rows with a resident row to compare under {argv[0]}", file=sys.stderr)
            return 2
        print("output tokens against resident's on the same request (0 differing: lossless)")
        print(a.to_string(index=False, na_rep="-"))
        return 0
    t = table(df)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print("SUMMARY " + json.dumps(t.to_dict(orient="records"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
