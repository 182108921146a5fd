"""The draft-depth sweep (experiment `depth`): mean TPOT against K per model, budget and system,
the K with the lowest mean TPOT marked (what `spec.k=auto` keeps: K* = argmin_K TPOT(K)),
and the paper's chosen depths (DeepSeek-V2-Lite 16, Qwen1.5-MoE 8, Phi-3.5-MoE 16) beside.
K* is chosen per engine profile; where the records hold more than one, each case has one panel
per profile side by side (one TPOT scale)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, PAPER_STYLE, RENAME, Result, agg, case_panels,
                                    case_columns, clock_note, col, dedup_legend, isnan, log2_x,
                                    panel_title, prepare, same_limits, save_figure, subplots,
                                    title, write_table)

NAME = "depth"
CASE = ["model", "family", "budget", "budget_slots", "hardware", "engine", "clock", "charged",
        "system"]


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    df["K"] = pd.to_numeric(col(df, "k"), errors="coerce").fillna(
        pd.to_numeric(col(df, "cfg.spec.k"), errors="coerce"))
    df = df[df["K"].notna()]
    t = agg(df, CASE + ["K"], ["tpot_ms", "acceptance_rate", "mean_accepted_len", "hit_rate"])
    t["K"] = t["K"].astype(int)
    timed = t[t["tpot_ms"].notna()]
    best = timed.loc[timed.groupby(CASE, dropna=False)["tpot_ms"].idxmin()]
    chosen = {tuple(r[c] for c in CASE): r["K"] for _, r in best.iterrows()}
    t["chosen (ours)"] = [chosen.get(tuple(r[c] for c in CASE)) == r["K"] for _, r in t.iterrows()]
    t[f"K* {PAPER_LABEL}"] = [paper.CHOSEN_K.get(f, float("nan")) for f in t["family"]]
    return t.sort_values(["model", "budget", "system", "hardware", "K"]).reset_index(drop=True)


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """One panel per model, budget and profile (profiles side by side); unsaved."""
    n, panels = case_panels(t)
    fig, axes = subplots(len(panels), ncols=n if n > 1 else 3, w=4.6, h=3.4)
    for ax, (model, budget, prof, g) in zip(axes, panels):
        for (system, clock), s in g.groupby(["system", "clock"], sort=True):
            s = s.sort_values("K")
            line, = ax.plot(s["K"], s["tpot_ms"], marker="o", label=f"{system} ({clock})")
            c = s[s["chosen (ours)"]]
            ax.plot(c["K"], c["tpot_ms"], marker="*", markersize=15, color=line.get_color(),
                    linestyle="none", label="K* ours")
        k = g[f"K* {PAPER_LABEL}"].iloc[0] if len(g) else float("nan")
        if not isnan(k):
            ax.axvline(k, color=PAPER_STYLE["color"], linestyle="--", linewidth=1.2,
                       label=f"K* {PAPER_LABEL} = {int(k)}")
        log2_x(ax, g["K"].unique(), "draft depth K")
        ax.set_ylabel("mean TPOT (ms)")
        ax.set_title(panel_title(f"{model}, budget {budget}", prof), fontsize=9)
        ax.grid(alpha=0.3)
        dedup_legend(ax)
    for k in range(0, len(axes), n):
        same_limits(axes[k:k + n])
    title(fig, "Draft depth sweep: TPOT vs K", df)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t, ["hardware", "clock", "charged", "system"]),
            "K", "rows", "tpot_ms", "acceptance_rate", "mean_accepted_len", "hit_rate",
            "chosen (ours)", f"K* {PAPER_LABEL}"]
    note = (clock_note(df) + ". chosen: the K with the lowest mean TPOT of its case (per profile). "
            "Paper: K* over K in {2,4,6,8,12,16,20,24,32}, 25 prompts x 3 runs; acceptance per draft "
            f"token {paper.ACCEPTANCE['mean']:.2%} mean, up to {paper.ACCEPTANCE['max_deepseek']:.0%} "
            f"on DeepSeek-V2-Lite, E[A] = {paper.ACCEPTANCE['expected_run']}.")
    paths = write_table(t[cols].rename(columns=RENAME), out, NAME, "Draft depth: mean TPOT per K", note)
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="depth", render=render)]
