"""Host-computed misses (experiment `hybrid`): per model and budget, each system's TPOT
relative to resident's, and what explains it: the fraction of misses the host computed
(`host_frac`), the hit rate, the hidden fraction of H2D time and the device's wait on the
host. Beyond the paper (no paper numbers); the issue's targets are drawn instead:
specter_hybrid within 1.3x of resident at the high budget, and ahead of specter at the low."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots.base import (RENAME, Result, agg, bars, by_profile, case_columns,
                                    clock_note, dedup_legend, palette, panel_title, prepare,
                                    save_figure, subplots, system_key, title, write_table)

NAME = "hybrid"
CASE = ["model", "family", "budget", "budget_slots", "hardware", "engine", "clock", "charged"]
TARGET_X_RESIDENT = 1.3


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    t = agg(df, CASE + ["system"], ["tpot_ms", "host_frac", "host_experts", "hit_rate",
                                    "h2d_hidden_frac", "host_wait_ms", "acceptance_rate"])
    keys = [k for k in CASE if k in t]
    res = t[t["system"] == "resident"].set_index(keys)["tpot_ms"]
    t["x_resident"] = [r["tpot_ms"] / res.get(tuple(r[k] for k in keys), float("nan"))
                       for _, r in t.iterrows()]
    spec = t[t["system"] == "specter"].set_index(keys)["tpot_ms"]
    t["x_specter"] = [r["tpot_ms"] / spec.get(tuple(r[k] for k in keys), float("nan"))
                      for _, r in t.iterrows()]
    t["_s"] = t["system"].map(system_key)
    return t.sort_values(["model", "budget", "hardware", "_s"]).drop(columns="_s") \
        .reset_index(drop=True)


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """Per model and profile: TPOT / resident per system, grouped by budget; unsaved."""
    models = sorted(t["model"].unique())
    split = by_profile(t)
    fig, axes = subplots(len(models) * len(split), ncols=len(split) if len(split) > 1 else 3,
                         w=5.0, h=3.4)
    systems = sorted((s for s in t["system"].unique() if s != "resident"), key=system_key)
    colors = palette(systems)
    i = 0
    for model in models:
        for prof, g in split:
            ax = axes[i]
            i += 1
            g = g[g["model"] == model]
            budgets = sorted(g["budget"].unique())
            bars(ax, budgets, {s: [g[(g["budget"] == b) & (g["system"] == s)]["x_resident"].mean()
                                   for b in budgets] for s in systems}, colors=colors)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.axhline(TARGET_X_RESIDENT, color="crimson", linestyle="--", linewidth=1.0,
                       label=f"target: specter_hybrid <= {TARGET_X_RESIDENT}x resident (high)")
            ax.set_ylabel("TPOT / resident TPOT")
            ax.set_title(panel_title(model, prof), fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    dedup_legend(axes[i - 1], outside=True, also=axes[:i - 1])
    title(fig, "Host-computed misses: TPOT relative to resident", df, paper_numbers=False)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t), "system", "rows", "tpot_ms",
            "x_resident", "x_specter", "host_frac", "host_experts", "hit_rate",
            "h2d_hidden_frac", "host_wait_ms", "acceptance_rate"]
    note = (clock_note(df, paper_numbers=False) + ". x_resident / x_specter: TPOT over "
            "resident's / specter's in the same case. host_frac: misses computed on the host "
            "/ all misses (verification's for the speculating systems); host_experts: their "
            "count per request; host_wait_ms: the device's wait for the host's results per "
            "request. Beyond the paper: no paper numbers.")
    paths = write_table(t[cols].rename(columns=RENAME), out, NAME,
                        "Host-computed misses: TPOT relative to resident", note)
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="hybrid", render=render)]
