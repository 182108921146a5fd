"""`python -m experiments.plots RESULTS_ROOT [--out figures] [--only NAME ...]`

Finds every results tree under RESULTS_ROOT (any folder with a `records/` subfolder, the root
included), loads each through `experiments.records.load`, concatenates them, and renders each
Result from the rows of its experiment. One line per result: the files written, or why none
were. Exit 0; 2 for a missing root or an unknown --only name; 1 when a render raised.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import pandas as pd

from experiments import records


def trees(root: Path) -> list[Path]:
    """Folders under `root` (itself included) that hold a `records/` folder of results."""
    found = [p.parent for p in sorted(root.rglob("records")) if p.is_dir()
             and "records" not in p.parent.relative_to(root).parts]
    if (root / "records").is_dir() and root not in found:
        found.insert(0, root)
    return found


def load_all(root: Path) -> pd.DataFrame:
    frames = [df for df in (records.load(t) for t in trees(root)) if not df.empty]
    if not frames:
        return pd.DataFrame()
    return pd.concat(frames, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    from experiments.plots import RESULTS

    ap = argparse.ArgumentParser(prog="python -m experiments.plots",
                                 description="The paper's figures and tables from parquet records.")
    ap.add_argument("root", help="a results tree, or a folder holding several")
    ap.add_argument("--out", default="figures", help="output folder (default: figures)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="render only these results")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        print(f"error: results root '{root}' does not exist or is not a folder.", file=sys.stderr)
        return 2
    names = [r.name for r in RESULTS]
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"error: unknown result {', '.join(unknown)}; choose from: {', '.join(names)}.",
                  file=sys.stderr)
            return 2
    df = load_all(root)
    out = Path(args.out)
    failed = 0
    for res in RESULTS:
        if args.only and res.name not in args.only:
            continue
        rows = df[df["experiment"] == res.experiment] if "experiment" in df else df.iloc[0:0]
        if rows.empty:
            print(f"{res.name}: skipped: no {res.experiment} records")
            continue
        try:
            paths = res.render(rows.reset_index(drop=True), out)
        except Exception as e:  # one broken render must not hide the others
            failed += 1
            traceback.print_exc(file=sys.stderr)
            print(f"{res.name}: FAILED: {type(e).__name__}: {e}")
            continue
        print(f"{res.name}: " + (", ".join(str(p) for p in paths) if paths else "nothing written"))
    return 1 if failed else 0
