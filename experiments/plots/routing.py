"""Routing fidelity of the models (experiment `routing`, records from
`python -m experiments.routing_report --out DIR`): per model, its expert working-set curve
(distinct experts per MoE layer needed by n consecutive tokens) against the real model's
target — the paper's published end at 17 tokens and the band of two interpolations between
the ends (docs/routing.md) — with uniform routing for reference; below, the INT4 self-draft's
acceptance against K (teacher-forced estimate) beside the paper's mean; a table with reuse,
load entropy, distinct-4 and routing fidelity beside the paper's."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, Result, col, dedup_legend, isnan,
                                    paper_marker, save_figure, subplots, write_table)

NAME = "routing"
NS = list(range(1, 18))
KS = (1, 2, 4, 8, 16)
NOTE = ("no clock: routing and tokens only. Measured on the benchmark prompts (greedy outputs "
        "of 16-token prompts, teacher-forced routing of the output positions). Target: the "
        "paper's working set at 17 tokens (DeepSeek-V2-Lite 31.7; Qwen1.5-MoE 4 x 7.18; "
        "Phi-3.5-MoE 2 x 4.65), between 1 and 17 tokens the band of the effective-pool and "
        "power-law curves through both ends (docs/routing.md); within 15% = the end within 15% "
        "and every point within 15% of the band. Acceptance: teacher-forced estimate of greedy "
        "speculation at depth K from the draft's per-token agreement")


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """One row per model: the last one recorded (a model's records differ only by build)."""
    return df.groupby("model", sort=True).tail(1).sort_values("model").reset_index(drop=True)


def table(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for _, r in latest(df).iterrows():
        fam = r.get("stands_for")
        rows.append({
            "model": r["model"], "stands for": fam if isinstance(fam, str) else "-",
            "E/top-k": f"{int(r['experts'])}/{int(r['top_k'])}",
            "router balance": r.get("router_balance", float("nan")),
            **{f"ws n={n}": r[f"ws_{n}"] for n in (1, 4, 8, 17, 33)},
            f"n=17 {PAPER_LABEL}": r.get("target_17", float("nan")),
            "dev n=17": r.get("dev_17", float("nan")),
            "worst dev n=2..16": r.get("worst_dev", float("nan")),
            "within 15%": r.get("within"),
            "reuse": r["reuse"], "load entropy": r["load_entropy"],
            "distinct-4": r["distinct_4"],
            "routing fidelity": r.get("fidelity_topk", float("nan")),
            f"fidelity {PAPER_LABEL}": paper.FIDELITY_GPTQ4.get(fam, float("nan")),
            "token match": r.get("draft_token_match", float("nan")),
            **{f"acc K={k}": r.get(f"acceptance_k{k}", float("nan")) for k in KS},
            f"acc {PAPER_LABEL}": paper.ACCEPTANCE["mean"]})
    return pd.DataFrame(rows)


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    paths = write_table(t, out, NAME, "Routing fidelity of the models vs the real ones", NOTE)
    last = latest(df)
    n = len(last)
    fig, axes = subplots(2 * n, ncols=n, w=4.2, h=3.2)
    for i, (_, r) in enumerate(last.iterrows()):
        ax, acc_ax = axes[i], axes[n + i]
        ys = [r[f"ws_{m}"] for m in NS]
        ax.plot(NS, ys, marker="o", markersize=3, label="measured")
        ax.plot(NS, [r[f"ws_random_{m}"] for m in NS], "k:", label="uniform random")
        if not isnan(col(last, "band_lo_2").iloc[i]):
            ax.fill_between(NS, [r[f"band_lo_{m}"] for m in NS], [r[f"band_hi_{m}"] for m in NS],
                            alpha=0.25, color="crimson", label="target band")
            paper_marker(ax, [1, 17], [r["band_lo_1"], r["target_17"]])
            verdict = "within 15%" if r.get("within") else f"off by {r['worst_dev']:+.0%} / " \
                                                          f"{r['dev_17']:+.0%} at 17"
        else:
            verdict = "no published target"
        fam = r.get("stands_for")
        ax.set_title(f"{r['model']} ({fam if isinstance(fam, str) else '-'}): {verdict}",
                     fontsize=9)
        ax.set_xlabel("tokens per forward (K + 1)")
        ax.set_ylabel("distinct experts / layer")
        ax.grid(alpha=0.3)
        acc = [r.get(f"acceptance_k{k}", float("nan")) for k in KS]
        acc_ax.plot(KS, acc, marker="o", label="acceptance (estimate)")
        acc_ax.axhline(paper.ACCEPTANCE["mean"], color="crimson", linestyle="--",
                       label=f"{PAPER_LABEL}: mean acceptance")
        fid = r.get("fidelity_topk", float("nan"))
        pf = paper.FIDELITY_GPTQ4.get(fam, float("nan"))
        acc_ax.set_title(f"routing fidelity {fid:.1%}"
                         + (f" ({PAPER_LABEL} {pf:.1%})" if not isnan(pf) else ""), fontsize=9)
        acc_ax.set_xscale("log", base=2)
        acc_ax.set_xticks(KS, [str(k) for k in KS])
        acc_ax.set_xlabel("draft depth K")
        acc_ax.set_ylabel("accepted / drafted")
        acc_ax.set_ylim(0, 1.02)
        acc_ax.grid(alpha=0.3)
    dedup_legend(axes[n - 1], outside=True, also=axes[:n - 1])
    dedup_legend(axes[2 * n - 1], outside=True)
    fig.suptitle("Routing of the models vs the real ones (no clock)", fontsize=10)
    paths += save_figure(fig, out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="routing", render=render)]
