"""The compiled draft step's table from scripts/bench_compile.sh's records (issue 36 item 4).

Per case (system, INT4 backend, spec.compile): TPOT on the case's clock, the draft step's time
(a window's draft time over its depth), the compile time and how many compilations ran.
A request whose first step compiled is left out of the TPOT and step medians (its time is
the compile's); the compile is its own column.

    python -m experiments.compile_table RESULTS_DIR [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments import records
from experiments.hotpath import markdown


def table(df: pd.DataFrame) -> pd.DataFrame:
    out = []
    for key, g in df.groupby(["system", "draft.backend", "draft_compiled"], dropna=False):
        first = g["draft_compiles"].fillna(0) > 0 if "draft_compiles" in g \
            else pd.Series(False, index=g.index)  # the requests that compiled
        kept = g[~first] if (~first).any() else g
        step = (kept["draft_ms_per_window"] / kept["k"]).median() if "k" in kept else float("nan")
        out.append({"system": key[0], "backend": key[1] if isinstance(key[1], str) else "-",
                    "draft step": "compiled" if key[2] == True else "eager",  # noqa: E712 (NaN: none)
                    "clock": g["clock"].iloc[0], "rows": len(kept),
                    "TPOT ms": kept["tpot_ms"].median(), "draft step ms": step,
                    "acceptance": kept.get("acceptance_rate", pd.Series(dtype=float)).median(),
                    "compile s": g["draft_compile_s"].fillna(0).sum() if "draft_compile_s" in g else 0.0,
                    "compiles": int(g["draft_compiles"].fillna(0).sum()) if "draft_compiles" in g else 0})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    df = records.load(a.results)
    for col in ("draft.backend", "draft_compiled"):
        if col not in df:
            df[col] = float("nan")
    t = table(df)
    text = markdown(t, index=False, floatfmt=".3g")
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
