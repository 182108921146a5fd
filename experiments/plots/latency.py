"""H2D hiding (experiment `latency`): per system the total copy-engine time of expert
transfers (`h2d_ms`), the compute stream's exposed wait on copies (`exposed_wait_ms`) and the
fraction of H2D time hidden behind compute (`h2d_hidden_frac`), per request; the paper's
hidden fractions of Specter per model beside."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, Result, agg, bars, clock_note, dedup_legend,
                                    isnan, paper_marker, prepare, save_figure, subplots,
                                    system_key, title, varying, write_table)

NAME = "h2d_hiding"


def paper_hidden(family, system) -> float:
    return paper.H2D_HIDDEN_FRAC.get(family, float("nan")) if system == "specter" else float("nan")


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    t = agg(df, ["model", "family", "budget", "budget_slots", "hardware", "clock", "charged",
                 "system"], ["h2d_ms", "exposed_wait_ms", "h2d_hidden_frac", "n_transfers",
                             "h2d_bytes", "tpot_ms", "e2e_ms"])
    t[f"hidden frac {PAPER_LABEL}"] = [paper_hidden(r["family"], r["system"]) for _, r in t.iterrows()]
    t["_s"] = t["system"].map(system_key)
    return t.sort_values(["model", "budget", "_s"]).drop(columns="_s").reset_index(drop=True)


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *varying(t, ["hardware", "clock", "charged"]),
            "system", "rows", "h2d_ms", "exposed_wait_ms", "h2d_hidden_frac", "n_transfers",
            "tpot_ms", "e2e_ms", f"hidden frac {PAPER_LABEL}"]
    note = (clock_note(df) + ". Per request (means over requests): h2d_ms = total expert-copy "
            "time; exposed_wait_ms = union of the intervals the compute stream waited on a copy; "
            "h2d_hidden_frac = (H2D - H2D intersect waits) / H2D.")
    paths = write_table(t[cols].rename(columns={"budget_slots": "slots", "tpot_ms": "TPOT ms",
                                                "e2e_ms": "e2e ms"}),
                        out, NAME, "H2D transfer time, exposed wait and hidden fraction", note)
    cases = list(t.groupby(["model", "budget"], sort=True))
    fig, axes = subplots(2 * len(cases), ncols=2, w=5.6, h=3.4)
    for i, ((model, budget), g) in enumerate(cases):
        systems = sorted(g["system"].unique(), key=system_key)
        pick = {s: g[g["system"] == s] for s in systems}
        ax = axes[2 * i]
        bars(ax, systems, {"H2D total": [pick[s]["h2d_ms"].mean() for s in systems],
                           "exposed wait": [pick[s]["exposed_wait_ms"].mean() for s in systems]})
        ax.set_ylabel("ms per request")
        ax.set_title(f"{model}, budget {budget}: copy time", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        dedup_legend(ax, outside=True)
        ax = axes[2 * i + 1]
        bars(ax, systems, {"ours": [pick[s]["h2d_hidden_frac"].mean() for s in systems]})
        pts = [(j, paper_hidden(g["family"].iloc[0], s)) for j, s in enumerate(systems)]
        pts = [p for p in pts if not isnan(p[1])]
        if pts:
            paper_marker(ax, *zip(*pts))
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("hidden fraction of H2D time")
        ax.set_title(f"{model}, budget {budget}: hidden fraction", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        dedup_legend(ax, outside=True)
    title(fig, "H2D hiding per system", df)
    paths += save_figure(fig, out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="latency", render=render)]
