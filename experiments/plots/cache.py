"""Expert-cache hit rates (experiment `cache`): the target's demand hit rate at verification
(`hit_rate`, per expert per layer-forward) beside its ceiling `hit_rate_cap` (the most a
slot-limited per-layer demand hit rate could reach: over layer-forwards, sum of min(slots,
experts needed) / experts needed) and the per (token, expert) hit rate (`hit_rate_tokens`),
per model x budget x system (and engine profile, one panel each where the records hold more
than one); the paper's DeepSeek-V2-Lite hit rates of Specter at 16 / 24 / 32 GB beside our
low / high / xhigh budgets. The table adds the speculating systems' `prefetch_precision` and
`plan_recall`, so a reader can set each of our metrics beside the paper's numbers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, RENAME, Result, agg, bars, by_profile,
                                    case_columns, clock_note, dedup_legend, isnan, palette,
                                    panel_title, paper_marker, prepare, save_figure, subplots,
                                    system_key, title, write_table)

NAME = "cache_hit_rate"
BUDGETS = ["low", "high", "xhigh", "full"]
METRICS = ["hit_rate", "hit_rate_cap", "hit_rate_tokens", "prefetch_precision", "plan_recall",
           "tpot_ms"]
CAP_LABEL = "cap: slots / distinct experts (hit_rate_cap)"
CAP_STYLE = dict(marker="_", markersize=13, markeredgewidth=2.2, color="black", linestyle="none",
                 zorder=4)


def paper_hit(family, budget, system) -> float:
    if family != "deepseek" or system != "specter" or budget not in paper.HIT_RATE_DEEPSEEK:
        return float("nan")
    return paper.HIT_RATE_DEEPSEEK[budget][1]


def budget_key(b) -> tuple:
    return (BUDGETS.index(b) if b in BUDGETS else len(BUDGETS), str(b))


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    t = agg(df, ["model", "family", "budget", "budget_slots", "hardware", "engine", "clock",
                 "charged", "system"], METRICS)
    t[f"hit rate {PAPER_LABEL}"] = [paper_hit(r["family"], r["budget"], r["system"])
                                    for _, r in t.iterrows()]
    t["paper budget GB"] = [paper.HIT_RATE_DEEPSEEK[r["budget"]][0]
                            if not isnan(paper_hit(r["family"], r["budget"], r["system"]))
                            else float("nan") for _, r in t.iterrows()]
    t["_b"], t["_s"] = t["budget"].map(budget_key), t["system"].map(system_key)
    return t.sort_values(["model", "_b", "_s", "hardware"]).drop(columns=["_b", "_s"]).reset_index(drop=True)


def note(df: pd.DataFrame) -> str:
    lo, hi, xh = (paper.HIT_RATE_DEEPSEEK[b] for b in ("low", "high", "xhigh"))
    return (clock_note(df) + ". hit_rate: demand hits / requests per expert per layer-forward "
            "of the target at verification (prefill excluded); hit_rate_cap: the most a "
            "slot-limited per-layer demand hit rate could reach (sum over layer-forwards of "
            "min(slots, experts needed) / experts needed); hit_rate_tokens: per (token, expert) "
            "request; prefetch_precision (speculating systems): of the experts the plans copied, the "
            "share verification needed; plan_recall: of the experts verification needed, the share "
            "its plan named (pinned or copied). "
            f"Paper: Specter on DeepSeek-V2-Lite at {lo[0]}/{hi[0]}/{xh[0]} GB, shown beside our "
            f"low/high/xhigh budgets. The paper's {lo[1]:.2%}/{hi[1]:.2%}/{xh[1]:.2%} at "
            f"{lo[0]}/{hi[0]}/{xh[0]} GB falls as memory grows, which no slot-limited per-layer "
            "demand hit rate can do, so the comparison is not like for like; the table lists "
            "our metrics beside it without naming one as its counterpart.")


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """Per model hit_rate (bars; black dash: hit_rate_cap; red diamonds: the paper) and
    hit_rate_tokens, each with one panel per profile side by side; unsaved."""
    models = sorted(t["model"].unique())
    split = by_profile(t)
    n = len(split)
    colors = palette(sorted(t["system"].unique(), key=system_key))
    # one profile: [hit_rate, hit_rate_tokens] per row; several: a row per metric, profiles across
    fig, axes = subplots(2 * n * len(models), ncols=n if n > 1 else 2, w=4.8, h=3.4)
    for i, model in enumerate(models):
        row = axes[2 * n * i: 2 * n * (i + 1)]
        for j, (prof, gp) in enumerate(split):
            g = gp[gp["model"] == model]
            budgets = sorted(t[t["model"] == model]["budget"].unique(), key=budget_key)
            labels = [f"{b} ({int(t[(t['model'] == model) & (t['budget'] == b)]['budget_slots'].iloc[0])})"
                      for b in budgets]
            systems = sorted(t[t["model"] == model]["system"].unique(), key=system_key)
            pick = lambda s, b, m: g[(g["system"] == s) & (g["budget"] == b)][m].mean()  # noqa: E731
            for k, metric in enumerate(["hit_rate", "hit_rate_tokens"]):
                ax = row[k * n + j]  # the same metric's profiles side by side
                xs = bars(ax, labels, {s: [pick(s, b, metric) for b in budgets] for s in systems},
                          colors=colors)
                if metric == "hit_rate":
                    for s in systems:
                        cap = [(x, pick(s, b, "hit_rate_cap")) for x, b in zip(xs[s], budgets)]
                        cap = [c for c in cap if not isnan(c[1])]
                        if cap:
                            ax.plot(*zip(*cap), label=CAP_LABEL, **CAP_STYLE)
                    if "specter" in xs and len(g):
                        pts = [(x, paper_hit(g["family"].iloc[0], b, "specter"))
                               for x, b in zip(xs["specter"], budgets)]
                        pts = [p for p in pts if not isnan(p[1])]
                        if pts:
                            paper_marker(ax, *zip(*pts), label=f"{PAPER_LABEL}: Specter, 16/24/32 GB")
                ax.set_ylim(0, 1.05)
                ax.set_ylabel(metric)
                ax.set_xlabel("budget (slots per layer)")
                ax.set_title(panel_title(f"{model}: {metric}", prof), fontsize=9)
                ax.grid(axis="y", alpha=0.3)
        dedup_legend(row[-1], outside=True, also=row[:-1])
    title(fig, "Hit rate of the target's expert demand at verification", df)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t), "system", "rows", "hit_rate",
            "hit_rate_cap", "hit_rate_tokens", "prefetch_precision", "plan_recall", "tpot_ms",
            f"hit rate {PAPER_LABEL}", "paper budget GB"]
    paths = write_table(t[cols].rename(columns=RENAME), out, NAME,
                        "Expert-cache hit rate per budget and system", note(df))
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="cache", render=render)]
