"""Expert-cache hit rates (experiment `cache`): the target's demand hit rate at verification
(`hit_rate`, per expert per layer-forward) and per (token, expert) request
(`hit_rate_tokens`), per model x budget x system; the paper's DeepSeek-V2-Lite hit rates of
Specter at 16 / 24 / 32 GB beside our low / high / xhigh budgets."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, Result, agg, bars, clock_note, dedup_legend,
                                    isnan, paper_marker, prepare, save_figure, subplots,
                                    system_key, title, varying, write_table)

NAME = "cache_hit_rate"
BUDGETS = ["low", "high", "xhigh", "full"]


def paper_hit(family, budget, system) -> float:
    if family != "deepseek" or system != "specter" or budget not in paper.HIT_RATE_DEEPSEEK:
        return float("nan")
    return paper.HIT_RATE_DEEPSEEK[budget][1]


def budget_key(b) -> tuple:
    return (BUDGETS.index(b) if b in BUDGETS else len(BUDGETS), str(b))


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    t = agg(df, ["model", "family", "budget", "budget_slots", "hardware", "clock", "charged",
                 "system"], ["hit_rate", "hit_rate_tokens", "prefetch_precision", "tpot_ms"])
    t[f"hit rate {PAPER_LABEL}"] = [paper_hit(r["family"], r["budget"], r["system"])
                                    for _, r in t.iterrows()]
    t["paper budget GB"] = [paper.HIT_RATE_DEEPSEEK[r["budget"]][0]
                            if not isnan(paper_hit(r["family"], r["budget"], r["system"]))
                            else float("nan") for _, r in t.iterrows()]
    t["_b"], t["_s"] = t["budget"].map(budget_key), t["system"].map(system_key)
    return t.sort_values(["model", "_b", "_s"]).drop(columns=["_b", "_s"]).reset_index(drop=True)


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *varying(t, ["hardware", "clock", "charged"]),
            "system", "rows", "hit_rate", "hit_rate_tokens", "prefetch_precision", "tpot_ms",
            f"hit rate {PAPER_LABEL}", "paper budget GB"]
    note = (clock_note(df) + ". hit_rate: demand hits / requests per expert per layer-forward "
            "of the target at verification (prefill excluded); hit_rate_tokens: per (token, "
            "expert) request. Paper: Specter on DeepSeek-V2-Lite at 16/24/32 GB, shown beside "
            "our low/high/xhigh budgets.")
    paths = write_table(t[cols].rename(columns={"budget_slots": "slots", "tpot_ms": "TPOT ms"}),
                        out, NAME, "Expert-cache hit rate per budget and system", note)
    models = sorted(t["model"].unique())
    fig, axes = subplots(2 * len(models), ncols=2, w=5.2, h=3.4)
    for i, model in enumerate(models):
        g = t[t["model"] == model]
        budgets = sorted(g["budget"].unique(), key=budget_key)
        labels = [f"{b} ({int(g[g['budget'] == b]['budget_slots'].iloc[0])})" for b in budgets]
        systems = sorted(g["system"].unique(), key=system_key)
        for j, metric in enumerate(["hit_rate", "hit_rate_tokens"]):
            ax = axes[2 * i + j]
            xs = bars(ax, labels, {s: [g[(g["system"] == s) & (g["budget"] == b)][metric].mean()
                                      for b in budgets] for s in systems})
            if metric == "hit_rate" and "specter" in xs:
                pts = [(x, paper_hit(g["family"].iloc[0], b, "specter"))
                       for x, b in zip(xs["specter"], budgets)]
                pts = [p for p in pts if not isnan(p[1])]
                if pts:
                    paper_marker(ax, *zip(*pts), label=f"{PAPER_LABEL}: Specter, 16/24/32 GB")
            ax.set_ylim(0, 1.05)
            ax.set_ylabel(metric)
            ax.set_xlabel("budget (slots per layer)")
            ax.set_title(model, fontsize=9)
            ax.grid(axis="y", alpha=0.3)
            dedup_legend(ax, outside=True)
    title(fig, "Hit rate of the target's expert demand at verification", df)
    paths += save_figure(fig, out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="cache", render=render)]
