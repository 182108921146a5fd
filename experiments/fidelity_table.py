"""The routing-fidelity table from parquet: `python -m experiments.fidelity_table OUT_DIR`.

One row per (model, method, bits): mean top-k match over requests (each request's mean over
MoE layers and output positions), its spread across requests (min), top-1 match, how often
the draft's greedy token equals the target's, the draft's bytes, and the per-layer means.
Ends with one machine-readable JSON line; `--csv FILE` also writes the table.
"""

from __future__ import annotations

import json
import sys

import pandas as pd

from experiments import records


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = df[df["system"] == "fidelity"].copy()
    keys = ["model", "draft.method", "draft.bits", "draft.effective_groups"]
    out = df.groupby(keys).agg(
        requests=("fidelity_topk", "size"), topk_match=("fidelity_topk", "mean"),
        topk_min=("fidelity_topk", "min"), top1_match=("fidelity_top1", "mean"),
        draft_token_match=("draft_token_match", "mean"), draft_bytes=("draft.bytes", "first"),
        distinct_4=("distinct_4", "mean")).reset_index()
    per_layer = df.groupby(keys)["fidelity_per_layer"].apply(
        lambda s: [round(sum(v) / len(v), 4) for v in zip(*[json.loads(x) if isinstance(x, str) else list(x) for x in s])])
    out["per_layer"] = per_layer.values
    return out.sort_values(keys).reset_index(drop=True)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m experiments.fidelity_table OUT_DIR [--csv FILE]", file=sys.stderr)
        return 2
    df = records.load(argv[0])
    if df.empty or "fidelity_topk" not in df:
        print(f"error: no fidelity records under {argv[0]}", file=sys.stderr)
        return 2
    t = table(df)
    with pd.option_context("display.width", 220, "display.max_columns", 30, "display.max_colwidth", 60):
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if "--csv" in argv:
        t.to_csv(argv[argv.index("--csv") + 1], index=False)
    print("SUMMARY " + json.dumps(t.drop(columns=["per_layer"]).to_dict(orient="records"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
