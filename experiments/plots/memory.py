"""Device memory of one shared draft/target instance against two separate models (experiment
`memory`, records from `python -m experiments.memory_table --out DIR`): per real model, budget
and context the stacked bytes (non-expert weights, INT4 draft experts, the target's resident
slots, KV cache) of each arrangement and the saving; the paper's Qwen1.5-MoE 12K-context
figures (7.68 GB shared vs 13.40 GB separate, -43%) beside."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, Result, dedup_legend, isnan, paper_marker,
                                    save_figure, subplots, write_table)

NAME = "memory"
PARTS = ["non_expert_GB", "int4_draft_GB", "target_slots_GB", "kv_GB"]
NOTE = (f"ours: byte accounting of the real models' configs (no clock, no hardware: FP16 target, "
        f"INT4 GPTQ draft g128); paper: {paper.HARDWARE}, Qwen1.5-MoE at a 12K context (budget "
        f"not stated)")


def _paper(model, context, key) -> float:
    q = paper.MEMORY_QWEN_12K
    return q[key] if model == "qwen" and context == q["context"] else float("nan")


def table(df: pd.DataFrame) -> pd.DataFrame:
    keys = ["model", "budget", "budget_slots", "context"]
    t = df.groupby(keys, sort=True)[PARTS + ["shared_GB", "separate_GB", "saving"]].mean().reset_index()
    t["context"], t["budget_slots"] = t["context"].astype(int), t["budget_slots"].astype(int)
    for key in ("shared_GB", "separate_GB", "saving"):
        t[f"{key} {PAPER_LABEL}"] = [_paper(m, c, key) for m, c in zip(t["model"], t["context"])]
    return t


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    note = NOTE + ". shared: one copy of everything but the routed experts, one KV cache; separate: " \
                  "a draft and a target model, each with its own non-expert weights and KV cache."
    paths = write_table(t.rename(columns={"budget_slots": "slots"}), out, NAME,
                        "Device memory: shared instance vs two separate models (GB)", note)
    cases = list(t.groupby("context", sort=True))
    fig, axes = subplots(len(cases), ncols=1, w=max(6.0, 1.1 * t.groupby("context").size().max() + 2), h=3.8)
    colors = {"non_expert_GB": "tab:blue", "int4_draft_GB": "tab:orange",
              "target_slots_GB": "tab:green", "kv_GB": "tab:purple"}
    for ax, (context, g) in zip(axes, cases):
        g = g.reset_index(drop=True)
        x = np.arange(len(g))
        for dx, arrangement, mult, hatch in ((-0.2, "shared", (1, 1, 1, 1), ""),
                                              (0.2, "separate", (2, 1, 1, 2), "//")):
            bottom = np.zeros(len(g))
            for part, m in zip(PARTS, mult):
                h = g[part].to_numpy() * m
                ax.bar(x + dx, h, 0.38, bottom=bottom, color=colors[part], hatch=hatch,
                       edgecolor="white", label=part.removesuffix("_GB").replace("_", " "))
                bottom += h
            for xi, total in zip(x + dx, bottom):
                ax.text(xi, total, f"{total:.1f}", ha="center", va="bottom", fontsize=7)
        for key, dx in (("shared_GB", -0.2), ("separate_GB", 0.2)):
            pts = [(xi + dx, v) for xi, v in zip(x, g[f"{key} {PAPER_LABEL}"]) if not isnan(v)]
            if pts:
                paper_marker(ax, *zip(*pts), label=f"{PAPER_LABEL}: Qwen1.5-MoE 12K")
        ax.set_xticks(x)
        ax.set_xticklabels([f"{m}\n{b} ({s})" for m, b, s in zip(g["model"], g["budget"], g["budget_slots"])],
                           fontsize=8)
        ax.set_ylabel("device GB")
        ax.set_title(f"context {int(context)} tokens (left: shared, right hatched: separate)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        dedup_legend(ax, outside=True)
    fig.suptitle("Device memory of the draft/target pair\n" + "\n".join(textwrap.wrap(NOTE, 120)),
                 fontsize=9)
    paths += save_figure(fig, out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="memory", render=render)]
