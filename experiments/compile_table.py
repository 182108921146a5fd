"""The compiled draft step's table from scripts/bench_compile.sh's records (issue 36 item 4).

Per case (system, INT4 backend, compiled or eager: a speculative system's draft step under
`spec.compile`, resident's decode step under `system.compile`): TPOT on the case's clock, the
draft step's time (a window's draft time over its depth), the compile time and how many
compilations ran.
The runner compiles in an untimed request (`compile_warmup_s`, one per run) before the timed
ones; a request whose first step compiled anyway (older records, or larger buffers) is left out
of the TPOT and step medians (its time is the compile's). The compile is its own column.

    python -m experiments.compile_table RESULTS_DIR [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments import records
from experiments.hotpath import show


def _either(g: pd.DataFrame, draft: str, decode: str) -> pd.Series:
    """A compiled-step column: the draft's (speculative systems) or resident's decode step's."""
    out = pd.Series(float("nan"), index=g.index, dtype=object)
    for col in (draft, decode):
        if col in g:
            out = out.where(out.notna(), g[col])
    return out


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    if "draft.backend" not in df:  # resident's rows alone
        df["draft.backend"] = float("nan")
    df["_compiled"] = _either(df, "draft_compiled", "decode_compiled").map(
        lambda v: False if v is None or (isinstance(v, float) and v != v) else bool(v))
    df["_compiles"] = pd.to_numeric(_either(df, "draft_compiles", "decode_compiles"),
                                    errors="coerce").fillna(0)
    df["_compile_s"] = pd.to_numeric(_either(df, "draft_compile_s", "decode_compile_s"),
                                     errors="coerce").fillna(0)
    out = []
    for key, g in df.groupby(["system", "draft.backend", "_compiled"], dropna=False):
        first = g["_compiles"] > 0  # the requests that compiled (before the runner's warm-up)
        runs = (g.drop_duplicates("run_id")["compile_warmup_s"].fillna(0)
                if "compile_warmup_s" in g else pd.Series(dtype=float))  # one untimed request a run
        warmup, warmups = runs.sum(), int((runs > 0).sum())
        kept = g[~first] if (~first).any() else g
        step = (kept["draft_ms_per_window"] / kept["k"]).median() \
            if "k" in kept and "draft_ms_per_window" in kept else float("nan")
        out.append({"system": key[0], "backend": key[1] if isinstance(key[1], str) else "-",
                    "step": "compiled" if key[2] else "eager",
                    "clock": g["clock"].iloc[0], "rows": len(kept),
                    "TPOT ms": kept["tpot_ms"].median(), "draft step ms": step,
                    "acceptance": kept.get("acceptance_rate", pd.Series(dtype=float)).median(),
                    "compile s": g["_compile_s"].sum() + warmup,
                    "compiles": int(g["_compiles"].sum()) + warmups})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    t = table(records.load(a.results))
    show(t, a.out, floatfmt=".3g")

if __name__ == "__main__":
    main()
