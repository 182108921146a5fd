"""Which design is fastest as the host's memory bandwidth grows (experiment `crossover`, issue
37): per model and budget, TPOT against the host's bandwidth, one line per system (Specter and
resident do not use the host: a flat line from their one run), with the paper's server and a
desktop host marked (conf/host/). The table names the fastest system at each named host and
the bandwidth where host_experts meets Specter (interpolated linearly between the two swept
bandwidths around it). Beyond the paper: no paper numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib.ticker import NullFormatter

from experiments.plots.base import (RENAME, Result, agg, case_columns, clock_note, dedup_legend,
                                    palette, prepare, save_figure, subplots, system_key, title,
                                    write_table)

NAME = "crossover"
CASE = ["model", "budget", "hardware", "engine", "clock", "charged"]
BW = "cfg.hardware.host_mem_bandwidth_Bps"
HOSTS = ("epyc7742_2s", "desktop_ddr5_2ch")  # the named hosts marked (conf/host/)
CONF_HOST = Path(__file__).resolve().parents[2] / "conf" / "host"


def named_hosts() -> dict[str, float]:
    """Each marked host's streamed bandwidth in GB/s, read from its conf/host/ profile."""
    return {h: float(yaml.safe_load((CONF_HOST / f"{h}.yaml").read_text())["host_mem_bandwidth_Bps"]) / 1e9
            for h in HOSTS}


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = prepare(df)
    df["host_GBps"] = df[BW].astype(float) / 1e9
    return agg(df, CASE + ["system", "host_GBps"], ["tpot_ms", "acceptance_rate"])


def tpot_at(t: pd.DataFrame, system: str, gbps: float) -> float:
    """A system's TPOT at `gbps` (its one run when it does not use the host; NaN where not swept)."""
    g = t[t["system"] == system]
    if len(g) == 1:
        return float(g["tpot_ms"].iloc[0])
    hit = g[np.isclose(g["host_GBps"], gbps)]
    return float(hit["tpot_ms"].iloc[0]) if len(hit) else float("nan")


def crossing(t: pd.DataFrame, system: str, against: str) -> float:
    """The host bandwidth (GB/s) where `system`'s TPOT meets `against`'s, interpolated between
    the swept bandwidths around the first sign change; NaN when it never changes sign."""
    g = t[t["system"] == system].sort_values("host_GBps")
    x = g["host_GBps"].to_numpy()
    d = np.array([tpot - tpot_at(t, against, bw) for bw, tpot in zip(x, g["tpot_ms"])])
    for i in range(len(d) - 1):
        if d[i] == 0:
            return float(x[i])
        if d[i] * d[i + 1] < 0:
            return float(x[i] + (x[i + 1] - x[i]) * d[i] / (d[i] - d[i + 1]))
    return float("nan")


def answer(t: pd.DataFrame) -> pd.DataFrame:
    """Per case: the fastest system at each named host, and the crossovers against Specter."""
    hosts, rows = named_hosts(), []
    for key, g in t.groupby([k for k in CASE if k in t], dropna=False):
        row = dict(zip([k for k in CASE if k in t], key))
        for host, gbps in hosts.items():
            tp = {s: tpot_at(g, s, gbps) for s in g["system"].unique() if s != "resident"}
            tp = {s: v for s, v in tp.items() if v == v}
            row[f"fastest at {host} ({gbps:g} GB/s)"] = min(tp, key=tp.get) if tp else ""
        for system in ("host_experts", "host_experts_s", "specter_hybrid"):
            if system in set(g["system"]) and "specter" in set(g["system"]):
                row[f"{system} = specter at GB/s"] = crossing(g, system, "specter")
        rows.append(row)
    return pd.DataFrame(rows)


def figure(t: pd.DataFrame, df: pd.DataFrame):
    cases = t[["model", "budget"]].drop_duplicates().sort_values(["model", "budget"])
    fig, axes = subplots(len(cases), ncols=2, w=5.0, h=3.4)
    systems = sorted(t["system"].unique(), key=system_key)
    colors = palette(systems)
    xs = sorted(t["host_GBps"].unique())
    for ax, (_, c) in zip(axes, cases.iterrows()):
        g = t[(t["model"] == c["model"]) & (t["budget"] == c["budget"])]
        for s in systems:
            h = g[g["system"] == s].sort_values("host_GBps")
            if len(h) == 1:  # does not use the host: one run, drawn flat
                ax.plot([min(xs), max(xs)], [h["tpot_ms"].iloc[0]] * 2, color=colors[s],
                        linestyle="--", label=s)
            elif len(h):
                ax.plot(h["host_GBps"], h["tpot_ms"], marker="o", color=colors[s], label=s)
        for host, gbps in named_hosts().items():
            ax.axvline(gbps, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(host, (gbps, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        rotation=90, va="top", ha="right")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("host memory bandwidth (GB/s)")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{c['model']}, budget {c['budget']}", fontsize=9)
        ax.grid(alpha=0.3)
    dedup_legend(axes[len(cases) - 1], outside=True, also=axes[:len(cases) - 1])
    title(fig, "Specter or the host's experts: TPOT against the host's memory bandwidth", df,
          paper_numbers=False)
    return fig


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    t = table(df)
    note = (clock_note(df, paper_numbers=False) + ". The host's FLOP rate is the server's "
            "(conf/host/epyc7742_2s.yaml); its bandwidth is swept. Systems that do not use the "
            "host (specter, resident) ran once. Beyond the paper: no paper numbers.")
    cols = ["model", "budget", *case_columns(t), "system", "host_GBps", "rows", "tpot_ms",
            "acceptance_rate"]
    paths = write_table(t[[c for c in cols if c in t]].rename(columns=RENAME), out, NAME,
                        "TPOT against the host's memory bandwidth", note)
    paths += write_table(answer(t).rename(columns=RENAME), out, NAME + "_answer",
                         "The fastest design per host, and where host_experts meets Specter",
                         note + " Crossovers interpolated linearly between swept bandwidths; "
                         "NaN: no crossing in the swept range.")
    paths += save_figure(figure(t, df), out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="crossover", render=render)]
