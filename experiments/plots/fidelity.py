"""Routing fidelity of the quantized self-draft (experiment `fidelity`, system `fidelity`):
the method x bits table (experiments.fidelity_table's rows, with the paper's top-k match beside,
and the paper's methods we do not run as paper-only rows), the distributions per request, per
MoE layer and per output position, and top-k match against bits per method."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import fidelity_table
from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, Result, clock_note, dedup_legend, family, isnan,
                                    paper_marker, save_figure, subplots, title, write_table)

NAME = "fidelity"
PAPER_COL = f"top-k match {PAPER_LABEL}"


def _list(v) -> list[float]:
    if isinstance(v, str):
        return json.loads(v)
    return [] if v is None or (isinstance(v, float) and np.isnan(v)) else list(v)


def paper_match(fam, method, bits) -> float:
    if method in paper.GPTQ_METHODS and bits == 4 and fam in paper.FIDELITY_GPTQ4:
        return paper.FIDELITY_GPTQ4[fam]
    return float("nan")


def prepared(df: pd.DataFrame) -> pd.DataFrame:
    df = df[df["system"] == "fidelity"].copy()
    # effective_groups may come back as a list (unhashable): group by its JSON text
    df["draft.effective_groups"] = df["draft.effective_groups"].map(
        lambda v: v if isinstance(v, str) else json.dumps([int(x) for x in _list(v)]))
    df["draft.bits"] = df["draft.bits"].astype(int)
    df["family"] = df.apply(family, axis=1) if len(df) else []
    return df


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepared(df)
    t = fidelity_table.table(df)
    fams = df.groupby("model")["family"].first()
    t.insert(1, "family", t["model"].map(fams))
    t[PAPER_COL] = [paper_match(r["family"], r["draft.method"], r["draft.bits"]) for _, r in t.iterrows()]
    extra = []
    for model, fam in fams.items():  # the paper's other methods, on DeepSeek-V2-Lite only
        if fam != "deepseek":
            continue
        for (method, bits), v in paper.FIDELITY_METHODS_DEEPSEEK.items():
            if method in paper.GPTQ_METHODS:
                continue
            extra.append({"model": model, "family": fam, "draft.method": f"{method} (paper only)",
                          "draft.bits": bits, PAPER_COL: v})
    if extra:
        t = pd.concat([t, pd.DataFrame(extra)], ignore_index=True)
    return t.sort_values(["model", "draft.method", "draft.bits"]).reset_index(drop=True)


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "draft.method", "draft.bits", "requests", "topk_match", "topk_min",
            "top1_match", "draft_token_match", "draft_bytes", PAPER_COL]
    note = (clock_note(df) + ". top-k match: per request the mean over MoE layers and output "
            "positions of |top-k(draft) & top-k(target)| / k on the target's own greedy output; "
            "topk_min: the lowest request. Paper: GPTQ INT4 per model; on DeepSeek-V2-Lite also "
            "GGUF Q2/Q4/Q8 and AWQ (methods this project does not run).")
    tab = t[cols].rename(columns={"draft.method": "method", "draft.bits": "bits",
                                  "draft_token_match": "draft token = target's"})
    paths = write_table(tab, out, NAME, "Routing fidelity of the quantized self-draft", note)
    paths += _distributions(prepared(df), out)
    paths += _bits(t, df, out)
    return paths


def _distributions(df: pd.DataFrame, out: Path) -> list[Path]:
    models = sorted(df["model"].unique())
    fig, axes = subplots(3 * len(models), ncols=3, w=4.8, h=3.3)
    for i, model in enumerate(models):
        g = df[df["model"] == model]
        fam = g["family"].iloc[0]
        variants = sorted(g.groupby(["draft.method", "draft.bits"]).groups)
        labels = [f"{m}-{b}b" for m, b in variants]
        sel = [g[(g["draft.method"] == m) & (g["draft.bits"] == b)] for m, b in variants]
        ax = axes[3 * i]
        ax.boxplot([s["fidelity_topk"].to_numpy() for s in sel], tick_labels=labels)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        pts = [(j + 1, paper_match(fam, m, b)) for j, (m, b) in enumerate(variants)]
        pts = [p for p in pts if not isnan(p[1])]
        if pts:
            paper_marker(ax, *zip(*pts))
        ax.set_ylabel("top-k match per request")
        ax.set_title(f"{model}: per request", fontsize=9)
        dedup_legend(ax, loc="lower left")
        ax = axes[3 * i + 1]
        for lab, s in zip(labels, sel):
            layers = np.array([_list(v) for v in s["fidelity_per_layer"]], dtype=float)
            x = np.arange(layers.shape[1])
            ax.plot(x, layers.mean(axis=0), marker="o", markersize=3, label=lab)
            ax.fill_between(x, layers.min(axis=0), layers.max(axis=0), alpha=0.15)
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("top-k match (band: min-max)")
        ax.set_title(f"{model}: per layer", fontsize=9)
        dedup_legend(ax, loc="lower left")
        ax = axes[3 * i + 2]
        for lab, s in zip(labels, sel):
            pos = np.sort(np.concatenate([np.asarray(_list(v), dtype=float)
                                          for v in s["fidelity_per_position"]]))
            ax.step(pos, np.arange(1, len(pos) + 1) / len(pos), where="post", label=lab)
        ax.set_xlabel("top-k match at an output position (mean over layers)")
        ax.set_ylabel("fraction of positions <= x")
        ax.set_title(f"{model}: per position (ECDF)", fontsize=9)
        dedup_legend(ax, loc="upper left")
    title(fig, "Routing fidelity distributions: draft vs target top-k experts", df)
    return save_figure(fig, out, f"{NAME}_distributions")


def _bits(t: pd.DataFrame, df: pd.DataFrame, out: Path) -> list[Path]:
    models = sorted(t["model"].unique())
    fig, axes = subplots(len(models), ncols=3, w=4.6, h=3.3)
    for ax, model in zip(axes, models):
        g = t[t["model"] == model]
        ours = g[g["topk_match"].notna()]
        for method, m in ours.groupby("draft.method"):
            m = m.sort_values("draft.bits")
            ax.plot(m["draft.bits"], m["topk_match"], marker="o", label=f"ours: {method}")
        p = g[g[PAPER_COL].notna()]
        for method, m in p.groupby(p["draft.method"].str.replace(" (paper only)", "", regex=False)):
            paper_marker(ax, m["draft.bits"], m[PAPER_COL],
                         label=f"{PAPER_LABEL}: {'GPTQ' if method in paper.GPTQ_METHODS else method.upper()}",
                         marker={"gguf": "s", "awq": "^"}.get(method, "D"))
        ax.set_xticks([2, 3, 4, 8])
        ax.set_xlabel("bits")
        ax.set_ylabel("mean top-k match")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
        dedup_legend(ax, loc="lower right")
    title(fig, "Routing fidelity vs bits per quantization method", df)
    return save_figure(fig, out, f"{NAME}_bits")


RESULTS = [Result(name=NAME, experiment="fidelity", render=render)]
