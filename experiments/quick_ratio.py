"""The quick profile's check against `--small` (issue 37 item 5): Specter's lead over
SpecMoEOff (SpecMoEOff's mean TPOT over Specter's, SpecMoEOff at its own K = 3, Specter at
the run's K) per model, budget and hardware profile, in each results folder, and how far the
quick lead is from the `--small` one.

    python -m experiments.quick_ratio QUICK_MAIN_DIR SMALL_MAIN_DIR [--out FILE.md]

Each folder is a main step's records (e.g. results/quick/main, results/small/main). A tuned
SpecMoEOff (`spec.tune_own_k=true`) is its own variant and is left out. Means are over every
request of the case, all datasets together, as the main table's are. The last two columns
repeat the check with `--small`'s records cut to the quick case's datasets, which separates
the choice of datasets from the rest of the quick workload.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments import records
from experiments.hotpath import show

KEYS = ["model", "budget", "hardware"]


def leads(df: pd.DataFrame) -> pd.DataFrame:
    """Per (model, budget, hardware): Specter's and SpecMoEOff's mean TPOT and the lead."""
    df = df[df["system"].isin(["specter", "specmoeoff"])]
    if "cfg.spec.tune_own_k" in df:
        df = df[~df["cfg.spec.tune_own_k"].fillna(False).astype(bool)]
    tpot = df.pivot_table(index=KEYS, columns="system", values="tpot_ms", aggfunc="mean")
    tpot = tpot.dropna(subset=[c for c in ("specter", "specmoeoff") if c in tpot])
    if tpot.empty or not {"specter", "specmoeoff"} <= set(tpot.columns):
        return pd.DataFrame(columns=[*KEYS, "specter", "specmoeoff", "lead"])
    tpot["lead"] = tpot["specmoeoff"] / tpot["specter"]
    return tpot.reset_index()


def compare(quick: pd.DataFrame, small: pd.DataFrame) -> pd.DataFrame:
    """The quick lead beside `--small`'s, with the relative difference; then `--small`'s lead
    on the quick case's datasets alone, and the difference from it: what is left once the
    choice of datasets is taken out (the shorter workload, the K profiled on fewer prompts)."""
    q, s = leads(quick), leads(small)
    both = q.merge(s, on=KEYS, suffixes=(" quick", " small"))
    both["quick vs small"] = both["lead quick"] / both["lead small"] - 1.0
    cols = [*KEYS, "lead quick", "lead small", "quick vs small"]
    if "dataset" in quick and "dataset" in small:
        same = leads(small[small["dataset"].isin(set(quick["dataset"]))])
        same = same.rename(columns={"lead": "lead small, quick's datasets"})
        both = both.merge(same[[*KEYS, "lead small, quick's datasets"]], on=KEYS, how="left")
        both["same datasets"] = both["lead quick"] / both["lead small, quick's datasets"] - 1.0
        cols += ["lead small, quick's datasets", "same datasets"]
    return both[cols]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("quick", type=Path)
    ap.add_argument("small", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    t = compare(records.load(a.quick), records.load(a.small))
    show(t, a.out, floatfmt=".3f")

if __name__ == "__main__":
    main()
