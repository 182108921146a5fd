"""H2D hiding (experiment `latency`): per system the total copy-engine time of expert
transfers (`h2d_ms`), the compute stream's exposed wait on copies (`exposed_wait_ms`) and the
fraction of H2D time hidden behind compute (`h2d_hidden_frac`), per request; the paper's
hidden fractions of Specter per model beside. Where the records hold more than one engine
profile, each case's panels come once per profile, side by side on one scale."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, RENAME, Result, agg, bars, by_profile,
                                    case_columns, clock_note, dedup_legend, isnan, panel_title,
                                    paper_marker, prepare, same_limits, save_figure, subplots,
                                    system_key, title, write_table)

NAME = "h2d_hiding"


def paper_hidden(family, system) -> float:
    return paper.H2D_HIDDEN_FRAC.get(family, float("nan")) if system == "specter" else float("nan")


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    t = agg(df, ["model", "family", "budget", "budget_slots", "hardware", "engine", "clock", "charged",
                 "system"], ["h2d_ms", "exposed_wait_ms", "h2d_hidden_frac", "n_transfers",
                             "h2d_bytes", "tpot_ms", "e2e_ms"])
    t[f"hidden frac {PAPER_LABEL}"] = [paper_hidden(r["family"], r["system"]) for _, r in t.iterrows()]
    t["_s"] = t["system"].map(system_key)
    return t.sort_values(["model", "budget", "_s", "hardware"]).drop(columns="_s").reset_index(drop=True)


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """Per model and budget copy time and hidden fraction, each once per profile side by side;
    unsaved."""
    cases = list(t.groupby(["model", "budget"], sort=True))
    split = by_profile(t)
    n = len(split)
    # one profile: [copy time, hidden fraction] per row; several: a row each, profiles across
    fig, axes = subplots(2 * n * len(cases), ncols=n if n > 1 else 2, w=5.0, h=3.4)
    for i, ((model, budget), c) in enumerate(cases):
        row = axes[2 * n * i: 2 * n * (i + 1)]
        systems = sorted(c["system"].unique(), key=system_key)
        for j, (prof, gp) in enumerate(split):
            g = gp[(gp["model"] == model) & (gp["budget"] == budget)]
            pick = {s: g[g["system"] == s] for s in systems}
            ax = row[j]
            bars(ax, systems, {"H2D total": [pick[s]["h2d_ms"].mean() for s in systems],
                               "exposed wait": [pick[s]["exposed_wait_ms"].mean() for s in systems]},
                 colors={"H2D total": "tab:blue", "exposed wait": "tab:orange"})
            ax.set_ylabel("ms per request")
            ax.set_title(panel_title(f"{model}, budget {budget}: copy time", prof), fontsize=9)
            ax.grid(axis="y", alpha=0.3)
            ax = row[n + j]
            bars(ax, systems, {"ours": [pick[s]["h2d_hidden_frac"].mean() for s in systems]},
                 colors={"ours": "tab:green"})
            pts = [(k, paper_hidden(c["family"].iloc[0], s)) for k, s in enumerate(systems)]
            pts = [p for p in pts if not isnan(p[1])]
            if pts:
                paper_marker(ax, *zip(*pts))
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("hidden fraction of H2D time")
            ax.set_title(panel_title(f"{model}, budget {budget}: hidden fraction", prof), fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        same_limits(row[:n])
        dedup_legend(row[n - 1], outside=True, also=row[:n - 1])
        dedup_legend(row[-1], outside=True, also=row[n:-1])
    title(fig, "H2D hiding per system", df)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t), "system", "rows", "h2d_ms",
            "exposed_wait_ms", "h2d_hidden_frac", "n_transfers", "tpot_ms", "e2e_ms",
            f"hidden frac {PAPER_LABEL}"]
    note = (clock_note(df) + ". Per request (means over requests): h2d_ms = total expert-copy "
            "time; exposed_wait_ms = union of the intervals the compute stream waited on a copy; "
            "h2d_hidden_frac = (H2D - H2D intersect waits) / H2D.")
    paths = write_table(t[cols].rename(columns={**RENAME, "e2e_ms": "e2e ms"}),
                        out, NAME, "H2D transfer time, exposed wait and hidden fraction", note)
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="latency", render=render)]
