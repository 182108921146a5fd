"""Batched decoding (experiment `batch`): per system and batch size B, the mean TPOT of a
sequence and the batch throughput (committed tokens of a batch / its time from start to last
commit, on the run's clock), with what explains them: hit rate, hidden fraction of H2D time,
experts copied per committed token, acceptance. The paper's batch-32 points on
DeepSeek-V2-Lite (Specter 119.2 ms / 130.3 tok/s, SpecMoEOff 718.0 / 40.2, MO-SM
1262.9 / 25.3, Transformers 1493.6 / 21.4) beside ours, and the throughput ratios against
Specter measured in the same sweep."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, RENAME, Result, by_profile, case_columns,
                                    clock_note, col, dedup_legend, log2_x, palette, panel_title,
                                    paper_marker, prepare, same_limits, save_figure, subplots,
                                    system_key, title, write_table)

NAME = "batch"
CASE = ["model", "family", "budget", "budget_slots", "hardware", "engine", "clock", "charged",
        "system", "B"]
PAPER_B = 32


def experts_per_token(df: pd.DataFrame) -> pd.Series:
    """Experts copied to the device per committed token of the batch, in units of the charged
    model's expert (a move of a modelled expert standing for several real layers counts as
    that many real experts): h2d_bytes / expert bytes / batch tokens."""
    expert = pd.to_numeric(col(df, "charged.expert_params"), errors="coerce") \
        * pd.to_numeric(col(df, "charged.elem_bytes"), errors="coerce")
    return pd.to_numeric(col(df, "h2d_bytes"), errors="coerce") / expert \
        / pd.to_numeric(col(df, "batch_tokens"), errors="coerce")


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    df["B"] = pd.to_numeric(col(df, "cfg.workload.batch", 1), errors="coerce").fillna(1).astype(int)
    df["experts_per_token"] = experts_per_token(df)
    metrics = ["tpot_ms", "hit_rate", "h2d_hidden_frac", "experts_per_token", "acceptance_rate"]
    keys = [k for k in CASE if k in df]
    for m in metrics + ["batch_tokens_per_s"]:
        df[m] = pd.to_numeric(col(df, m), errors="coerce")
    g = df.groupby(keys, dropna=False, sort=True)
    t = g[metrics].mean().reset_index()
    t["rows"] = g.size().values
    # throughput: per batch (the columns repeat on each of its rows), then the mean over batches
    per_batch = df.drop_duplicates(keys + ["batch_id", "repeat"]) if "batch_id" in df else df
    tp = per_batch.groupby(keys, dropna=False, sort=True)["batch_tokens_per_s"].mean()
    t["throughput_tok_s"] = tp.values
    t["batches"] = per_batch.groupby(keys, dropna=False, sort=True).size().values
    ref = t[t["system"] == "specter"].set_index([k for k in keys if k != "system"])
    ratio = []
    for _, r in t.iterrows():
        key = tuple(r[k] for k in keys if k != "system")
        s = ref["throughput_tok_s"].get(key, float("nan")) if len(ref) else float("nan")
        ratio.append(s / r["throughput_tok_s"] if r["throughput_tok_s"] else float("nan"))
    t["specter_throughput_x"] = ratio
    t["tpot_x_tput"] = t["tpot_ms"] * t["throughput_tok_s"] / 1e3
    pts = [paper.BATCH32_DEEPSEEK.get(s) if f == "deepseek" and b == PAPER_B else None
           for s, f, b in zip(t["system"], t["family"], t["B"])]
    t[f"TPOT ms {PAPER_LABEL}"] = [p[0] if p else float("nan") for p in pts]
    t[f"tok/s {PAPER_LABEL}"] = [p[1] if p else float("nan") for p in pts]
    spec32 = paper.BATCH32_DEEPSEEK["specter"][1]
    t[f"specter x {PAPER_LABEL}"] = [spec32 / p[1] if p else float("nan") for p in pts]
    t["_s"] = t["system"].map(system_key)
    return t.sort_values(["model", "budget", "hardware", "_s", "B"]).drop(columns="_s") \
        .reset_index(drop=True)


def figure(t: pd.DataFrame, df: pd.DataFrame):
    """Per model, budget and profile: TPOT vs B and throughput vs B, one line per system,
    the paper's B=32 points as diamonds in the system's colour; unsaved."""
    cases = list(t.groupby(["model", "budget"], sort=True))
    split = by_profile(t)
    n = len(split)
    fig, axes = subplots(2 * n * len(cases), ncols=2 * n, w=4.8, h=3.6)
    colors = palette(sorted(t["system"].unique(), key=system_key))
    for i, ((model, budget), _) in enumerate(cases):
        row = axes[2 * n * i: 2 * n * (i + 1)]
        for j, (prof, gp) in enumerate(split):
            g = gp[(gp["model"] == model) & (gp["budget"] == budget)]
            for metric, ax, label, p in (("tpot_ms", row[2 * j], "mean TPOT per sequence (ms)", 0),
                                         ("throughput_tok_s", row[2 * j + 1],
                                          "batch throughput (tokens/s)", 1)):
                for system, s in sorted(g.groupby("system"), key=lambda x: system_key(x[0])):
                    s = s.sort_values("B")
                    ax.plot(s["B"], s[metric], marker="o", color=colors[system], label=system)
                    fam = s["family"].iloc[0]
                    pt = paper.BATCH32_DEEPSEEK.get(system) if fam == "deepseek" else None
                    if pt:
                        paper_marker(ax, [PAPER_B], [pt[p]], color=colors[system],
                                     label=f"{PAPER_LABEL}, B={PAPER_B}")
                log2_x(ax, g["B"].unique(), "batch size B")
                ax.set_yscale("log")
                ax.set_ylabel(label)
                ax.set_title(panel_title(f"{model}, budget {budget}", prof), fontsize=9)
                ax.grid(alpha=0.3, which="both")
        same_limits(row[0::2])
        same_limits(row[1::2])
        dedup_legend(row[-1], outside=True, also=row[:-1])
    title(fig, "Batched decoding: TPOT and throughput vs batch size", df)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    cols = ["model", "budget", "budget_slots", *case_columns(t), "system", "B", "rows", "tpot_ms",
            "throughput_tok_s", "specter_throughput_x", "hit_rate", "h2d_hidden_frac",
            "experts_per_token", "acceptance_rate", "tpot_x_tput", f"TPOT ms {PAPER_LABEL}",
            f"tok/s {PAPER_LABEL}", f"specter x {PAPER_LABEL}"]
    note = (clock_note(df) + ". TPOT: mean over sequences of (last commit - first commit) / "
            "(tokens - 1); throughput: committed tokens of a batch / the batch's time from its "
            "start (prefill) to its last commit, mean over batches; specter x: Specter's "
            "throughput / this system's at the same B. experts/token: expert copies per "
            "committed token, in the charged (real) model's experts. Paper: batch 32 on "
            f"DeepSeek-V2-Lite, {paper.HARDWARE}. TPOT x throughput is the tokens a batch "
            "commits per TPOT interval: B where every row steps together (paper: MO-SM 31.95, "
            "Transformers 31.96 at B = 32), less where rows accept at different rates and the "
            "batch waits for its slowest row (paper: SpecMoEOff 28.9, Specter 15.5); "
            "tpot_x_tput gives ours.")
    paths = write_table(t[cols].rename(columns={**RENAME, "throughput_tok_s": "tok/s",
                                                "specter_throughput_x": "specter x",
                                                "experts_per_token": "experts/token"}),
                        out, NAME, "Batched decoding: TPOT and throughput per batch size", note)
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="batch", render=render)]
