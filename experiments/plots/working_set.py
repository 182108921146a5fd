"""Expert explosion (experiment `working_set`): distinct experts per MoE layer that one target
forward needs (`distinct_experts_per_forward`) against the draft depth K, per model, with the
paper's DeepSeek-V2-Lite endpoints (6.0 at 1 token, 31.7 at 16) beside. A speculative
forward verifies K+1 tokens and an autoregressive one (`lru`) one token, so the x axis is
tokens per target forward, the paper's "K consecutive tokens".

When the records hold a dense model (name containing "dense", e.g. the dense twin
`tiny_dense`/`small_dense`), a second panel: the speculative speedup at each K, mean TPOT of
`lru` (autoregressive; any K) / mean TPOT of `lru_s` at that K, one line per model: on a MoE
the working set grows with K and eats the gain, on a dense model it cannot grow.

Where the records hold more than one engine profile, each panel comes once per profile, side by
side (the working set follows the routing and should agree; the speedup follows the profile)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, RENAME, Result, agg, by_profile, case_columns,
                                    clock_note, col, dedup_legend, panel_title, paper_marker,
                                    prepare, same_limits, save_figure, subplots, title,
                                    write_table)

NAME = "working_set"
CASE = ["model", "family", "budget", "budget_slots", "hardware", "engine", "clock", "charged"]
AUTOREGRESSIVE = "lru"
SPECULATIVE = "lru_s"


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    df["K"] = pd.to_numeric(col(df, "k"), errors="coerce")  # the depth the run used
    df["K"] = df["K"].fillna(pd.to_numeric(col(df, "cfg.spec.k"), errors="coerce"))
    spec = df[pd.to_numeric(col(df, "k"), errors="coerce").notna()].copy()
    t = agg(spec, CASE + ["system", "K"], ["distinct_experts_per_forward", "distinct_experts_mean",
                                             "tpot_ms", "acceptance_rate", "hit_rate"])
    t["tokens/forward"] = t["K"] + 1
    auto = agg(df[df["system"] == AUTOREGRESSIVE], CASE + ["system"],
               ["distinct_experts_per_forward", "distinct_experts_mean", "tpot_ms", "hit_rate"])
    auto["K"], auto["tokens/forward"] = float("nan"), 1
    t = pd.concat([auto, t], ignore_index=True)
    # growth of the working set: distinct per forward over the 1-token forward of the same case
    base = {tuple(r[c] for c in CASE): r["distinct_experts_per_forward"]
            for _, r in t[t["tokens/forward"] == 1].iterrows()}
    t["growth vs 1 token"] = [r["distinct_experts_per_forward"] / base[tuple(r[c] for c in CASE)]
                              if tuple(r[c] for c in CASE) in base else float("nan")
                              for _, r in t.iterrows()]
    ar = {tuple(r[c] for c in CASE): r["tpot_ms"] for _, r in auto.iterrows()}
    t["speculative speedup"] = [
        ar.get(tuple(r[c] for c in CASE), float("nan")) / r["tpot_ms"]
        if r["system"] == SPECULATIVE and r["tpot_ms"] > 0 else float("nan") for _, r in t.iterrows()]
    # the paper's n consecutive tokens: our row with n tokens per forward, else the K = n row
    tokens = {tuple(r[c] for c in CASE): set() for _, r in t.iterrows()}
    for _, r in t.iterrows():
        tokens[tuple(r[c] for c in CASE)].add(r["tokens/forward"])

    def at(r, n: int) -> bool:
        return r["tokens/forward"] == n or (n not in tokens[tuple(r[c] for c in CASE)] and r["K"] == n)

    t[f"distinct {PAPER_LABEL}"] = [
        next((v for n, v in paper.EXPLOSION_DEEPSEEK.items() if at(r, n)), float("nan"))
        if r["family"] == "deepseek" else float("nan") for _, r in t.iterrows()]
    t[f"growth {PAPER_LABEL}"] = [
        paper.EXPLOSION_GROWTH_1_TO_16.get(r["family"], float("nan")) if at(r, 16) else float("nan")
        for _, r in t.iterrows()]
    return t.sort_values(["model", "budget", "hardware", "tokens/forward"]).reset_index(drop=True)


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t),
            "system", "K", "tokens/forward", "rows", "distinct_experts_per_forward",
            "growth vs 1 token", "distinct_experts_mean", "tpot_ms", "acceptance_rate",
            "speculative speedup", f"distinct {PAPER_LABEL}", f"growth {PAPER_LABEL}"]
    note = (clock_note(df) + ". distinct_experts_per_forward: distinct routed experts per MoE "
            "layer needed by one target forward (K+1 tokens for lru_s at depth K, 1 for lru); "
            "distinct_experts_mean: per layer over a whole request. speculative speedup = TPOT(lru) "
            "/ TPOT(lru_s at K). Paper: DeepSeek-V2-Lite 6.0 -> 31.7 for K = 1 -> 16 consecutive "
            "tokens; growth 1 -> 16 Qwen 7.18x, Phi 4.65x; a paper value for n tokens sits on our row "
            "with n tokens per forward, else on the K = n row.")
    paths = write_table(t[cols].rename(columns=RENAME),
                        out, NAME, "Expert working set per target forward vs draft depth", note)
    paths += save_figure(figure(t, df), out, NAME)
    return paths


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """Expert explosion (and, with a dense model, the speculative speedup), one panel each per
    profile side by side; unsaved."""
    dense = any("dense" in str(m) for m in t["model"].unique())
    split = by_profile(t)
    n = len(split)
    fig, axes = subplots((2 if dense else 1) * n, ncols=n if n > 1 else 2, w=5.6, h=3.8)
    tops, bottoms = axes[:n], axes[n:]
    for j, (prof, tp) in enumerate(split):
        ax = tops[j]
        for (model, budget), g in tp.groupby(["model", "budget"], sort=True):
            g = g.sort_values("tokens/forward")
            ax.plot(g["tokens/forward"], g["distinct_experts_per_forward"], marker="o",
                    label=f"{model} ({budget})")
        paper_marker(ax, list(paper.EXPLOSION_DEEPSEEK), list(paper.EXPLOSION_DEEPSEEK.values()),
                     label=f"{PAPER_LABEL}: {paper.MODELS['deepseek']}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per target forward (K+1; autoregressive = 1)")
        ax.set_ylabel("distinct experts per layer per forward")
        ax.set_title(panel_title("Expert explosion", prof), fontsize=9)
        ax.grid(alpha=0.3)
        dedup_legend(ax, loc="best")
        if not dense:
            continue
        ax = bottoms[j]
        s = tp[tp["speculative speedup"].notna()]
        for (model, budget), g in s.groupby(["model", "budget"], sort=True):
            g = g.sort_values("K")
            ax.plot(g["K"], g["speculative speedup"], marker="o",
                    label=f"{model} ({'dense' if 'dense' in model else 'MoE'}, {budget})")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("draft depth K")
        ax.set_ylabel("TPOT(lru) / TPOT(lru_s at K)")
        ax.set_title(panel_title("Speculative speedup: MoE vs dense", prof), fontsize=9)
        ax.grid(alpha=0.3)
        dedup_legend(ax)
    same_limits(tops)
    same_limits(bottoms)
    title(fig, "Expert working set vs draft depth", df)
    return fig


RESULTS = [Result(name=NAME, experiment="working_set", render=render)]
