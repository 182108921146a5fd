"""The main result (experiment `main`): mean TPOT per model x budget x system x dataset, the
speedup over SpecMoEOff in the same case, and the paper's high-budget TPOTs beside; one bar
figure per model and budget (bars: systems, one per dataset; red diamonds: the paper)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots import paper
from experiments.plots.base import (PAPER_LABEL, Result, agg, bars, clock_note, dedup_legend,
                                    isnan, paper_marker, prepare, save_figure, slug, subplots,
                                    system_key, title, varying, write_table)

NAME = "main_tpot"
CASE = ["model", "budget", "budget_slots", "hardware", "clock", "charged"]


def paper_tpot(family, budget, system) -> float:
    if budget != "high":
        return float("nan")
    return paper.TPOT_HIGH_MS.get(family, {}).get(system, float("nan"))


def paper_speedup(family, budget, system) -> float:
    if system != "specter":
        return float("nan")
    return paper_tpot(family, budget, "specmoeoff") / paper_tpot(family, budget, "specter")


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
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


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    ours = t[(t["system"] == "specter") & t["speedup_vs_specmoeoff"].notna()]
    ours = ours[ours["dataset"] == "all"] if (ours["dataset"] == "all").any() else ours
    note = clock_note(df) + (f". Paper speedup of Specter over SpecMoEOff: "
                             f"{paper.SPEEDUP_VS_SPECMOEOFF['mean']:.2f}x mean, "
                             f"{paper.SPEEDUP_VS_SPECMOEOFF['max']:.2f}x max")
    if len(ours):
        note += (f"; ours: {ours['speedup_vs_specmoeoff'].mean():.2f}x mean, "
                 f"{ours['speedup_vs_specmoeoff'].max():.2f}x max over {len(ours)} case(s)")
    note += ". Paper TPOTs are the high budget's, means over the five datasets."
    cols = ["model", "budget", "budget_slots", *varying(t, ["hardware", "clock", "charged"]),
            "system", "dataset", "rows", "tpot_ms", "speedup_vs_specmoeoff", "acceptance_rate",
            f"TPOT {PAPER_LABEL}", f"speedup {PAPER_LABEL}"]
    tab = t[cols].rename(columns={"budget_slots": "slots", "tpot_ms": "TPOT ms",
                                  "speedup_vs_specmoeoff": "x SpecMoEOff",
                                  "acceptance_rate": "acceptance"})
    paths = write_table(tab, out, NAME, "Mean TPOT (ms) per model, budget, system and dataset", note)

    figs = t[t["dataset"] != "all"] if (t["dataset"] == "all").any() else t
    combos = list(figs.groupby(["model", "budget", "hardware", "clock", "charged"], dropna=False))
    several = figs.groupby(["model", "budget"]).ngroups < len(combos)
    for (model, budget, hw, clock, ch), g in combos:
        systems = sorted(g["system"].unique(), key=system_key)
        datasets = sorted(g["dataset"].astype(str).unique())
        series = {d: [g[(g["system"] == s) & (g["dataset"].astype(str) == d)]["tpot_ms"].mean()
                      for s in systems] for d in datasets}
        fig, (ax,) = subplots(1, w=max(5.0, 0.7 * len(systems) + 2), h=3.6)
        bars(ax, systems, series)
        fam = g["family"].iloc[0]
        px = [(i, paper_tpot(fam, budget, s)) for i, s in enumerate(systems)]
        px = [(i, v) for i, v in px if not isnan(v)]
        if px:
            paper_marker(ax, [i for i, _ in px], [v for _, v in px],
                         label=f"{PAPER_LABEL}: {paper.MODELS.get(fam, fam)}, high budget")
        ax.set_ylabel("mean TPOT (ms)")
        ax.set_xlabel("system")
        ax.grid(axis="y", alpha=0.3)
        dedup_legend(ax, outside=True, title="dataset")
        slots = g["budget_slots"].iloc[0]
        sub = df[(df["model"] == model) & (df["budget"] == budget)]
        sub = sub[(sub["hardware"] == hw) & (sub["clock"] == clock)] if "hardware" in sub else sub
        title(fig, f"TPOT: {model}, budget {budget} ({slots} slots/layer)", sub, bool(px))
        paths += save_figure(fig, out, slug(NAME, model, budget, *((hw, clock, ch) if several else ())))
    return paths


RESULTS = [Result(name=NAME, experiment="main", render=render)]
