"""The ablation (experiment `ablation`): mean TPOT of each Specter variant (its switches that
differ from the defaults, named by `experiments.summarize.variant`), per model and budget;
the paper's full / no PIO / no PIO+SIC / none ms/token beside the matching variants (on every
engine profile's panel: one per profile side by side, one TPOT scale, where the records hold
more than one)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, RENAME, Result, agg, case_columns, case_panels,
                                    clock_note, col, dedup_legend, isnan, panel_title,
                                    paper_marker, prepare, same_limits, save_figure, subplots,
                                    title, write_table)
from experiments.summarize import variant

NAME = "ablation"
SWITCHES = ("orchestrator", "shared", "reorder", "overlap")  # overlap=false: serial demand loading


def _paper_row(r):
    """The paper's row a Specter variant is: keyed by (orchestrator, shared, reorder); the
    artifact's "none" also loads serially (overlap off), every other row overlaps."""
    n = paper.ABLATION_MS.get(tuple(bool(r[s]) for s in SWITCHES[:3]))
    if n is None or bool(r["overlap"]) != (n[0] != "none"):
        return None
    return n


def _switch(v) -> bool:
    return True if v is None or (isinstance(v, float) and v != v) else bool(v)


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    df["variant"] = df.apply(variant, axis=1) if len(df) else []
    for s in SWITCHES:
        df[s] = col(df, f"cfg.system.{s}").map(_switch)
    t = agg(df, ["model", "budget", "budget_slots", "hardware", "engine", "clock", "charged", "system",
                 "variant", *SWITCHES], ["tpot_ms", "acceptance_rate", "hit_rate", "h2d_hidden_frac"])
    named = [_paper_row(r) if r["system"] == "specter" else None for _, r in t.iterrows()]
    t["paper variant"] = [n[0] if n else "" for n in named]
    t[f"ms/token {PAPER_LABEL}"] = [n[1] if n else float("nan") for n in named]
    t["_on"] = -t[list(SWITCHES)].sum(axis=1)
    return t.sort_values(["model", "budget", "hardware", "_on", "variant"]).drop(
        columns="_on").reset_index(drop=True)


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """One panel per model, budget and profile (profiles side by side, one TPOT scale); unsaved."""
    n, panels = case_panels(t)
    rows = t.groupby(["model", "budget", "hardware"]).size().max()
    fig, axes = subplots(len(panels), ncols=n if n > 1 else 2, w=6.0, h=0.45 * rows + 1.8)
    for ax, (model, budget, prof, g) in zip(axes, panels):
        g = g.reset_index(drop=True)
        labels = [v if not p else f"{v}  [{p}]" for v, p in zip(g["variant"], g["paper variant"])]
        y = list(range(len(g)))
        ax.barh(y, g["tpot_ms"].fillna(0), color="tab:blue", label="ours")
        pts = [(v, i) for i, v in enumerate(g[f"ms/token {PAPER_LABEL}"]) if not isnan(v)]
        if pts:
            paper_marker(ax, *zip(*pts))
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("mean TPOT (ms)")
        ax.set_title(panel_title(f"{model}, budget {budget}", prof), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        dedup_legend(ax, loc="lower right")
    for k in range(0, len(axes), n):  # one TPOT scale across a case's profiles
        same_limits(axes[k:k + n], axis="x")
    title(fig, "Ablation: orchestrator (PIO), shared instance (SIC), expert-grouped verification", df)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t, ["hardware", "clock", "charged", "system"]),
            "variant", *SWITCHES, "rows", "tpot_ms", "acceptance_rate", "hit_rate",
            "h2d_hidden_frac", "paper variant", f"ms/token {PAPER_LABEL}"]
    note = (clock_note(df) + ". variant: the switches that differ from Specter's defaults "
            "('-': full Specter). Paper: no PIO = orchestrator off; no PIO+SIC = also no shared "
            "instance; none = also no expert-grouped verification.")
    paths = write_table(t[cols].rename(columns=RENAME), out, NAME,
                        "Ablation: mean TPOT per Specter variant", note)
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="ablation", render=render)]
