"""The independent anchors (experiment `anchors`, experiments/anchors.py): ours against each
publication's number, one panel per engine kind, published numbers on x and ours on y, both
logarithmic, with the diagonal (agreement) and a factor-of-two band. Absolute numbers (tokens/s
or s/token, drawn as ms per token so every source shares one axis) on the left panels; ratios
inside one publication on the right ones. The table beside it is experiments.anchors' own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from experiments.plots.base import Result, clock_note, save_figure, subplots, write_table

NAME = "anchors"
MARKERS = {"Mixtral-offloading": "o", "MoE-Infinity": "s", "Speculating Experts": "^"}


def _short(source: str) -> str:
    return next((k for k in MARKERS if source.startswith(k)), source.split(" (")[0])


def _as_ms(quantity: str, v: float) -> float:
    """An absolute number as ms per token (tokens/s and s/token alike)."""
    if quantity.startswith("tokens/s"):
        return 1e3 / v
    if quantity.startswith("s/token"):
        return v * 1e3
    return v


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    from experiments import anchors

    t = anchors.table(df)
    t = t[t["ours"].notna()]
    if t.empty:
        return []
    note = (clock_note(df, paper_numbers=False) + ". x: the publication's number, y: ours; "
            "the diagonal is agreement, the band a factor of two. Medians: "
            + "; ".join(f"{r['source'].split(' (')[0]} {r['kind']} {r['engine']}: x{r['typical factor']:.2f}"
                        for _, r in anchors.medians(t).iterrows()))
    paths = write_table(t, out, NAME, "Independent anchors: ours beside each publication", note)
    engines = [e for e in anchors.ENGINES if (t["engine"] == e).any()]
    fig, axes = subplots(2 * len(engines), ncols=2, w=5.0, h=4.2)
    for i, e in enumerate(engines):
        for j, kind in enumerate(("absolute", "within")):
            ax = axes[2 * i + j]
            g = t[(t["engine"] == e) & (t["kind"] == kind)]
            for src, s in g.groupby(g["source"].map(_short), sort=False):
                x = [_as_ms(q, v) for q, v in zip(s["quantity"], s["paper"])]
                y = [_as_ms(q, v) for q, v in zip(s["quantity"], s["ours"])]
                ax.scatter(x, y, marker=MARKERS.get(src, "x"), label=src, alpha=0.8)
            vals = pd.concat([g["paper"], g["ours"]]) if kind == "within" else pd.Series(
                [_as_ms(q, v) for q, v in zip(g["quantity"], g["paper"])]
                + [_as_ms(q, v) for q, v in zip(g["quantity"], g["ours"])])
            vals = vals[vals > 0]
            if len(vals):
                lo, hi = float(vals.min()) / 2.5, float(vals.max()) * 2.5
                xs = np.geomspace(lo, hi, 20)
                ax.plot(xs, xs, color="black", linewidth=0.8)
                ax.fill_between(xs, xs / 2, xs * 2, color="grey", alpha=0.15, linewidth=0)
                ax.set_xlim(lo, hi)
                ax.set_ylim(lo, hi)
            ax.set_xscale("log")
            ax.set_yscale("log")
            unit = "ms per token" if kind == "absolute" else "ratio or share"
            ax.set_xlabel(f"published ({unit})")
            ax.set_ylabel(f"ours ({unit})")
            ax.set_title(f"{'absolute numbers' if kind == 'absolute' else 'within one publication'}"
                         f", {e} engine profiles", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Independent anchors: ours (virtual clock, real sizes charged) vs published",
                 fontsize=10)
    return paths + save_figure(fig, out, NAME)


RESULTS = [Result(name=NAME, experiment="anchors", render=render)]
