"""The main result (experiment `main`): mean TPOT per model x budget x system x dataset, the
speedup over SpecMoEOff in the same case, and the paper's high-budget TPOTs beside.

One figure per model and budget (and clock / charged sizes where those vary): one column of
panels per engine profile in the records (same y scales across profiles). On top the TPOT
panel (bars: systems, one per dataset; red diamonds: the paper's A100 TPOTs, on every
profile's panel), linear from 0 when the largest value is at most 8x the smallest, log when an
eager Transformers baseline's hundreds of ms would flatten the others. Below it the speedup
over SpecMoEOff (TPOT(SpecMoEOff) / TPOT(system), the mean over datasets; TPOT(resident) /
TPOT(system) where the case has no SpecMoEOff), bars from 1x on a log axis."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, RENAME, TUNED_SUFFIX, Result, agg, bars, by_profile,
                                    case_columns, clock_note, dedup_legend, isnan, log_axis, palette,
                                    panel_title, paper_marker, prepare, ratio_ticks, same_limits,
                                    save_figure, slug, subplots, system_key, title, tuned_apart,
                                    value_axis, write_table)

NAME = "main_tpot"
CASE = ["model", "budget", "budget_slots", "hardware", "engine", "clock", "charged"]
FIGURE = ["model", "budget", "clock", "charged"]  # one figure each; profiles are its columns
REFERENCES = ("specmoeoff", "resident")  # the speedup panel's reference, the first present


def paper_tpot(family, budget, system) -> float:
    if budget != "high":
        return float("nan")
    return paper.TPOT_HIGH_MS.get(family, {}).get(system, float("nan"))


def paper_speedup(family, budget, system) -> float:
    if system != "specter":
        return float("nan")
    return paper_tpot(family, budget, "specmoeoff") / paper_tpot(family, budget, "specter")


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = tuned_apart(prepare(df))
    metrics = ["tpot_ms", "acceptance_rate"]
    per_ds = agg(df, CASE + ["family", "system", "dataset"], metrics)
    if per_ds["dataset"].nunique() > 1:  # the paper's numbers are means over the datasets
        every = agg(df, CASE + ["family", "system"], metrics)
        every["dataset"] = "all"
        per_ds = pd.concat([per_ds, every], ignore_index=True)
    t = per_ds
    smo = {tuple(r[k] for k in CASE + ["dataset"]): r["tpot_ms"]
           for _, r in t[t["system"] == "specmoeoff"].iterrows()}
    t["speedup_vs_specmoeoff"] = [smo.get(tuple(r[k] for k in CASE + ["dataset"]), float("nan"))
                                  / r["tpot_ms"] if r["tpot_ms"] else float("nan")
                                  for _, r in t.iterrows()]
    headline = t["dataset"] == "all" if (t["dataset"] == "all").any() else t["dataset"].notna()
    t[f"TPOT {PAPER_LABEL}"] = [paper_tpot(r["family"], r["budget"], r["system"]) if h
                                else float("nan") for h, (_, r) in zip(headline, t.iterrows())]
    t[f"speedup {PAPER_LABEL}"] = [paper_speedup(r["family"], r["budget"], r["system"]) if h
                                   else float("nan") for h, (_, r) in zip(headline, t.iterrows())]
    t["_s"] = t["system"].map(system_key)
    t["_d"] = t["dataset"].map(lambda d: (d == "all", str(d)))
    return t.sort_values(["model", "budget", "hardware", "clock", "charged", "_d", "_s"]).drop(
        columns=["_s", "_d"]).reset_index(drop=True)


def _headline(g: pd.DataFrame) -> pd.DataFrame:
    """The rows averaged over datasets ('all'), or the rows themselves with one dataset."""
    return g[g["dataset"] == "all"] if (g["dataset"] == "all").any() else g


def case_figure(t: pd.DataFrame, df: pd.DataFrame, model, budget):
    """The TPOT and speedup panels of one case, one column per profile; returns
    (figure, TPOT axes, speedup axes) unsaved."""
    systems = sorted(t["system"].unique(), key=system_key)
    datasets = sorted({str(d) for d in t["dataset"] if d != "all"})
    ref = next((r for r in REFERENCES if r in systems), None)
    split = by_profile(t)
    n = len(split)
    panel_w = max(4.8, 0.9 * len(systems) + 1.0)  # about an inch per system's label
    fig, axes = subplots(2 * n if ref else n, ncols=n, w=panel_w + 3.4 / n, h=3.3)  # + legend
    tops, bottoms = axes[:n], axes[n:]
    colors = palette(datasets)
    fam = t["family"].iloc[0]
    px = [(i, paper_tpot(fam, budget, s)) for i, s in enumerate(systems)]
    px = [(i, v) for i, v in px if not isnan(v)]
    plabel = f"{PAPER_LABEL}: {paper.MODELS.get(fam, fam)}, high budget"
    plotted: list[float] = []  # every TPOT drawn, for one value axis over the profiles
    for j, (prof, g) in enumerate(split):
        ax = tops[j]
        per = g[g["dataset"] != "all"]
        series = {d: [per[(per["system"] == s) & (per["dataset"].astype(str) == d)]["tpot_ms"].mean()
                      for s in systems] for d in datasets}
        bars(ax, systems, series, colors=colors)
        plotted += [v for vs in series.values() for v in vs]
        if px:
            paper_marker(ax, [i for i, _ in px], [v for _, v in px], label=plabel)
            plotted += [v for _, v in px]
        ax.set_title(panel_title("TPOT", prof), fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
        if not ref:
            continue
        ax = bottoms[j]
        head = _headline(g)
        tp = {s: head[head["system"] == s]["tpot_ms"].mean() for s in systems}
        ys = [tp[ref] / tp[s] if tp[s] and not isnan(tp[s]) else float("nan") for s in systems]
        xs = list(range(len(systems)))
        # bars from 1 on a log axis: up = faster than the reference, down = slower
        ax.bar(xs, [0 if isnan(v) else v - 1 for v in ys], 0.6, bottom=1.0, color="tab:blue",
               label=f"ours ({'mean over datasets' if len(datasets) > 1 else datasets[0]})")
        log_axis(ax, suffix="x")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        if ref == "specmoeoff":
            sp = [(i, paper_tpot(fam, budget, ref) / paper_tpot(fam, budget, s))
                  for i, s in enumerate(systems)]
            sp = [(i, v) for i, v in sp if not isnan(v)]
            if sp:
                paper_marker(ax, [i for i, _ in sp], [v for _, v in sp], label=plabel)
        ax.set_xticks(xs)  # our speedups under the names, clear of the bars and diamonds
        ax.set_xticklabels([f"{s}\n{v:.2f}x" if not isnan(v) else s for s, v in zip(systems, ys)],
                           fontsize=7)
        ax.set_xlabel("system")
        ax.set_ylabel(f"TPOT({ref}) / TPOT(system), log")
        ax.set_title(panel_title(f"speedup over {'SpecMoEOff' if ref == 'specmoeoff' else ref}"
                                 " (>1: faster)", prof), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    if not ref:
        for ax in tops:
            ax.set_xlabel("system")
    value_axis(tops, plotted, "mean TPOT (ms)")
    same_limits(bottoms)
    for ax in bottoms:
        ratio_ticks(ax)
    dedup_legend(tops[-1], outside=True, also=tops[:-1], title="dataset")
    if ref:
        dedup_legend(bottoms[-1], outside=True, also=bottoms[:-1])
    slots = t["budget_slots"].iloc[0]
    slots = int(slots) if isinstance(slots, float) and slots.is_integer() else slots
    title(fig, f"TPOT: {model}, budget {budget} ({slots} slots/layer)", df, bool(px))
    return fig, tops, bottoms


def figures(t: pd.DataFrame, df: pd.DataFrame):
    """(file stem, figure) per case, unsaved."""
    combos = list(t.groupby(FIGURE, dropna=False, sort=True))
    several = t.groupby(["model", "budget"]).ngroups < len(combos)
    out = []
    for (model, budget, clock, ch), g in combos:
        sub = df[(df["model"] == model) & (df["budget"] == budget)]
        sub = sub[sub["clock"] == clock] if "clock" in sub else sub
        fig, _, _ = case_figure(g, sub, model, budget)
        out.append((slug(NAME, model, budget, *((clock, ch) if several else ())), fig))
    return out


def render(df: pd.DataFrame, out: Path, name: str = NAME) -> list[Path]:
    t = table(df)
    ours = t[(t["system"] == "specter") & t["speedup_vs_specmoeoff"].notna()]
    ours = ours[ours["dataset"] == "all"] if (ours["dataset"] == "all").any() else ours
    note = clock_note(df) + (f". Paper speedup of Specter over SpecMoEOff: "
                             f"{paper.SPEEDUP_VS_SPECMOEOFF['mean']:.2f}x mean, "
                             f"{paper.SPEEDUP_VS_SPECMOEOFF['max']:.2f}x max")
    tuned = {tuple(r[k] for k in CASE + ["dataset"]): r["tpot_ms"]
             for _, r in t[t["system"] == "specmoeoff" + TUNED_SUFFIX].iterrows()}
    if len(ours):
        for prof, o in by_profile(ours):
            note += (f"; ours{f' on {prof}' if prof else ''}: {o['speedup_vs_specmoeoff'].mean():.2f}x "
                     f"mean, {o['speedup_vs_specmoeoff'].max():.2f}x max over {len(o)} case(s)")
            lead = [tuned[key] / r["tpot_ms"] for _, r in o.iterrows()
                    if (key := tuple(r[k] for k in CASE + ["dataset"])) in tuned]
            if lead:  # the same baseline at the profiled K (spec.tune_own_k=true)
                note += (f", over SpecMoEOff at its tuned K {sum(lead) / len(lead):.2f}x mean over "
                         f"{len(lead)} case(s)")
    note += (". Paper TPOTs are the high budget's, means over the five datasets, measured on the "
             "A100 (shown beside every profile).")
    cols = ["model", "budget", "budget_slots", *case_columns(t), "system", "dataset", "rows",
            "tpot_ms", "speedup_vs_specmoeoff", "acceptance_rate", f"TPOT {PAPER_LABEL}",
            f"speedup {PAPER_LABEL}"]
    tab = t[cols].rename(columns={**RENAME, "speedup_vs_specmoeoff": "x SpecMoEOff",
                                  "acceptance_rate": "acceptance"})
    paths = write_table(tab, out, name, "Mean TPOT (ms) per model, budget, system and dataset", note)
    for stem, fig in figures(t, df):
        paths += save_figure(fig, out, stem.replace(NAME, name, 1))
    return paths


# `make run`'s main job (experiment=quickstart): the same table and figure, its own files.
RESULTS = [Result(name=NAME, experiment="main", render=render),
           Result(name="quickstart_tpot", experiment="quickstart",
                  render=lambda df, out: render(df, out, "quickstart_tpot"))]
