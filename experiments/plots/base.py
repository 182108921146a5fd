"""What every figure and table module shares: the `Result` record, saving figures (PNG and
PDF, Agg backend) and tables (Markdown and LaTeX), and the label naming the clock, the
engine profile (hardware name and engine) and the charged model sizes each number came from.

Engine profiles: the virtual clock has two per GPU, `<gpu>_ideal` (the roofline of an optimised
engine) and `<gpu>_hf` (an eager Hugging Face / PyTorch engine with framework costs). Records
carry `hardware` (the profile name) and, since the engine profiles, `engine`; older records lack `engine`
and it is derived from the name's suffix (`engine_of`). Where the records of a figure hold more
than one profile, the figure shows one panel per profile (`by_profile`) and the table a
`profile` / `engine` column (`case_columns`, `RENAME`).

Figures and tables read parquet records only (`experiments.records.load`, through the CLI);
a render gets the rows of its experiment and writes into the output folder.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.plots import paper  # noqa: E402


@dataclass(frozen=True)
class Result:
    name: str  # file stem under the output dir, e.g. "main_tpot"
    experiment: str  # the value of the records' `experiment` column this result reads
    render: Callable[[pd.DataFrame, Path], list[Path]]  # df filtered to `experiment`; returns paths


# Colours and markers used throughout: ours in the default cycle, the paper's in one style.
PAPER_STYLE = dict(marker="D", color="crimson", markersize=7, linestyle="none",
                   markeredgecolor="black", markeredgewidth=0.6, zorder=5)
PAPER_LABEL = "paper (A100)"


# ------------------------------------------------------------------------------- data helpers
def col(df: pd.DataFrame, name: str, default=float("nan")) -> pd.Series:
    """A column, or a constant one when the records do not have it."""
    if name in df:
        return df[name]
    return pd.Series(default, index=df.index, dtype=object if isinstance(default, str) else None)


def isnan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def family(row) -> str | None:
    """Which paper model a record's model stands for (deepseek / qwen / phi), if any."""
    name = row.get("model")
    if isinstance(name, str) and "dense" in name:  # a dense twin stands for no paper model
        return None
    sf = row.get("cfg.model.stands_for")
    if isinstance(sf, str) and sf:
        return sf
    return name if name in paper.MODELS else None


def with_family(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df["family"] = df.apply(family, axis=1) if len(df) else pd.Series(dtype=object)
    return df


# ------------------------------------------------------------------------- engine profiles
ENGINE_WORDS = {"hf": "eager engine", "ideal": "ideal roofline engine"}
ENGINE_ORDER = ["ideal", "hf"]


def _text(v) -> str | None:
    if v is None or isnan(v):
        return None
    v = str(v)
    return None if v in ("", "nan", "None", "NaN", "<NA>") else v


def engine_of(hardware, engine=None) -> str:
    """The engine a profile models: the records' `engine` where present, else the hardware
    name's suffix (`_hf` / `_ideal`), else '-'."""
    e = _text(engine)
    if e:
        return e
    hw = _text(hardware) or ""
    for suffix in ENGINE_ORDER:
        if hw.endswith(f"_{suffix}"):
            return suffix
    return "-"


def engines(df: pd.DataFrame) -> pd.Series:
    """`engine_of` per record."""
    return pd.Series([engine_of(h, e) for h, e in zip(col(df, "hardware", None), col(df, "engine", None))],
                     index=df.index, dtype=object)


def profile_label(hardware, engine=None) -> str:
    """'a100_pcie4_hf (eager engine)': the profile's name and, where known, its engine."""
    e = engine_of(hardware, engine)
    hw = _text(hardware) or "unknown"
    return f"{hw} ({ENGINE_WORDS.get(e, f'{e} engine')})" if e != "-" else hw


def _profile_key(hw: str, engine: str) -> tuple:
    base = hw[: -len(engine) - 1] if engine != "-" and hw.endswith(f"_{engine}") else hw
    return (base, ENGINE_ORDER.index(engine) if engine in ENGINE_ORDER else len(ENGINE_ORDER), hw)


def profiles(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The (hardware, engine) profiles of the records, ideal before hf per GPU."""
    if "hardware" not in df or df.empty:
        return []
    pairs: dict[str, str] = {}  # one engine per profile name (the first record's)
    for h, e in zip(df["hardware"], col(df, "engine", None)):
        if _text(h):
            pairs.setdefault(str(h), engine_of(h, e))
    return sorted(pairs.items(), key=lambda p: _profile_key(*p))


def by_profile(df: pd.DataFrame) -> list[tuple[str | None, pd.DataFrame]]:
    """[(profile label, its rows)] when the rows hold more than one profile, else
    [(None, all rows)]: figures draw one panel per entry, titled with the label."""
    profs = profiles(df)
    if len(profs) <= 1:
        return [(None, df)]
    hw = df["hardware"].astype(str)
    return [(profile_label(h, e), df[hw == h]) for h, e in profs]


def case_panels(t: pd.DataFrame) -> tuple[int, list[tuple]]:
    """(profiles, [(model, budget, profile label, rows)]): one panel per model, budget and
    profile, the profiles of a case side by side."""
    split = by_profile(t)
    panels = [(model, budget, prof, g[(g["model"] == model) & (g["budget"] == budget)])
              for (model, budget), _ in t.groupby(["model", "budget"], sort=True)
              for prof, g in split]
    return len(split), panels


def panel_title(text: str, profile: str | None) -> str:
    """A panel's title, naming its profile when the figure splits by profile."""
    return f"{text}\nprofile {profile}" if profile else text


def case_columns(t: pd.DataFrame, cols=("hardware", "clock", "charged")) -> list[str]:
    """`varying(t, cols)`, with `engine` beside `hardware` whenever the rows hold more than one
    profile (rename `hardware` to `profile` in the table with `RENAME`)."""
    v = varying(t, list(cols))
    if "hardware" in v and "engine" in t:
        v.insert(v.index("hardware") + 1, "engine")
    return v


RENAME = {"hardware": "profile", "budget_slots": "slots", "tpot_ms": "TPOT ms"}


def same_limits(axes, axis: str = "y") -> None:
    """One scale on several panels (the union of their limits), to compare them by eye."""
    axes = [a for a in axes if a is not None]
    if len(axes) < 2:
        return
    get, put = (("get_ylim", "set_ylim") if axis == "y" else ("get_xlim", "set_xlim"))
    lims = [getattr(a, get)() for a in axes]
    lo, hi = min(min(l) for l in lims), max(max(l) for l in lims)
    inverted = lims[0][0] > lims[0][1]
    for a in axes:
        getattr(a, put)((hi, lo) if inverted else (lo, hi))


def log_axis(ax, axis: str = "y", suffix: str = "") -> None:
    """A log axis ticked at 1, 2, 5 x 10^n with plain numbers (12, 50, 200 ms; 0.5x, 2x)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    a = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    a.set_minor_formatter(NullFormatter())


def _nice_floor(v: float) -> float:
    """The largest 1, 2 or 5 x 10^n at or below v (v > 0)."""
    e = math.floor(math.log10(v))
    return max(m * 10.0 ** e for m in (1, 2, 5) if m * 10.0 ** e <= v * (1 + 1e-9))


def value_axis(axes, values, label: str, linear_span: float = 8.0) -> None:
    """The value axis of bar panels, one scale on all of them. Linear from 0 when the largest
    plotted value is at most `linear_span` times the smallest, so bar lengths compare as the
    values do; log otherwise (an eager Transformers bar at 20-40x the others would flatten
    them), with the bottom a 1-2-5 step below the smallest value so every bar has length."""
    v = [float(x) for x in values if x is not None and math.isfinite(x) and x > 0]
    if not v:
        return
    lo, hi = min(v), max(v)
    for ax in axes:
        if hi / lo <= linear_span:
            ax.set_yscale("linear")
            ax.set_ylim(0, hi * 1.08)
            ax.set_ylabel(label)
        else:
            log_axis(ax)
            ax.set_ylim(_nice_floor(lo / 1.5), hi * 1.4)
            ax.set_ylabel(f"{label}, log scale")


RATIO_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0,
               3.0, 4.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def ratio_ticks(ax, suffix: str = "x") -> None:
    """Labelled ticks on a log ratio axis inside its current limits: the 1-2-5 steps, and the
    finer ones (0.8x, 1.25x, ...) where the span holds fewer than three of those."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    lo, hi = sorted(ax.get_ylim())
    coarse = [t for t in RATIO_TICKS if lo <= t <= hi and t / _nice_floor(t) in (1.0, 2.0, 5.0)]
    ticks = coarse if len(coarse) >= 3 else [t for t in RATIO_TICKS if lo <= t <= hi]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def charged(df: pd.DataFrame) -> pd.Series:
    """The sizes the virtual clock charged (`charged.source`), '-' for real-time clocks."""
    return col(df, "charged.source", "-").fillna("-").astype(str)


# ---------------------------------------------------------------------- clock / hardware label
def _values(df: pd.DataFrame, name: str) -> list[str]:
    if name not in df:
        return []
    return sorted({str(v) for v in df[name].dropna().unique() if str(v) not in ("", "nan", "None")})


def clock_note(df: pd.DataFrame, paper_numbers: bool = True) -> str:
    """One line: the clock(s), engine profile(s) (hardware name and engine, e.g. "profile
    a100_pcie4_hf (eager engine)"), charged sizes and device of our numbers, and the paper's
    hardware where the figure or table shows paper numbers."""
    clocks = _values(df, "clock") or ["unknown"]
    profs = [profile_label(h, e) for h, e in profiles(df)] or ["unknown"]
    parts = [f"ours: {'/'.join(clocks)} clock, profile{'s' if len(profs) > 1 else ''} "
             f"{' and '.join(profs)}"]
    ch = [c for c in _values(df, "charged.source") if c != "-"]
    if ch:
        parts.append(f"charged {'/'.join(ch)}")
    dev = _values(df, "device")
    if dev:
        parts.append(f"run on {'/'.join(dev)}")
    host = host_note(df)
    if host:
        parts.append(host)
    note = ", ".join(parts)
    if paper_numbers:
        note += f"; paper: {paper.HARDWARE}"
    return note


HOST_SYSTEMS = ("lru_hybrid", "specter_hybrid", "host_experts", "host_experts_s")


def host_note(df: pd.DataFrame) -> str:
    """The host CPU profile(s) (conf/host/) the host-computing systems among the rows ran
    with, e.g. "host epyc7742_2s (300 GB/s)"; empty when no such system is among them."""
    if "system" not in df or "cfg.hardware.host" not in df:
        return ""
    rows = df[df["system"].isin(HOST_SYSTEMS)]
    pairs = sorted({(str(h), float(b)) for h, b in zip(
        rows["cfg.hardware.host"], col(rows, "cfg.hardware.host_mem_bandwidth_Bps"))
        if str(h) not in ("", "nan", "None")})
    if not pairs:
        return ""
    names = sorted({h for h, _ in pairs})
    bws = sorted({b for _, b in pairs if b == b})
    rate = f" ({'/'.join(f'{b / 1e9:g}' for b in bws)} GB/s)" if bws else ""
    return f"host {'/'.join(names)}{rate}"


def title(fig, text: str, df: pd.DataFrame, paper_numbers: bool = True) -> None:
    """Figure title plus a second line naming the clock and hardware."""
    note = "\n".join(textwrap.wrap(clock_note(df, paper_numbers), 120))
    fig.suptitle(f"{text}\n{note}", fontsize=9)


def save_figure(fig, out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    fig.savefig(paths[0], dpi=130, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def subplots(n: int, ncols: int = 3, w: float = 4.6, h: float = 3.4, **kw):
    """n panels on a grid; returns (fig, flat list of the n axes), extra axes hidden."""
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows + 0.8), squeeze=False,
                             layout="constrained", **kw)
    flat = [a for row in axes for a in row]
    for a in flat[n:]:
        a.set_visible(False)
    return fig, flat[:n]


def log2_x(ax, values, label: str) -> None:
    """A base-2 log x axis with a tick at each of `values` (depths K, batch sizes B)."""
    ax.set_xscale("log", base=2)
    ticks = sorted(values)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(int(v)) for v in ticks], fontsize=7)
    ax.set_xlabel(label)


def paper_marker(ax, xs, ys, label: str = PAPER_LABEL, **kw) -> None:
    ax.plot(xs, ys, label=label, **{**PAPER_STYLE, **kw})


def dedup_legend(ax, outside: bool = False, also=(), **kw) -> None:
    """One legend entry per label; `outside`: to the right of the axes, clear of the data;
    `also`: further axes whose entries join this legend (one legend for a row of panels)."""
    seen: dict[str, object] = {}
    for a in (ax, *also):
        for h, lab in zip(*a.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if outside:
        kw = {**kw, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=7, **kw)


def bars(ax, categories: list[str], series: dict[str, list[float]], width: float = 0.8,
         colors: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Grouped bars: one group per category, one bar per series; returns each series' x.
    `colors`: a fixed colour per series name (the same series the same colour in every panel)."""
    n = max(1, len(series))
    w = width / n
    xs: dict[str, list[float]] = {}
    for i, (name, values) in enumerate(series.items()):
        x = [c - width / 2 + w * (i + 0.5) for c in range(len(categories))]
        kw = {"color": colors[name]} if colors and name in colors else {}
        ax.bar(x, [0 if isnan(v) else v for v in values], w, label=name, **kw)
        xs[name] = x
    ax.set_xticks(range(len(categories)))
    ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
    return xs


# ------------------------------------------------------------------------------------ tables
def _fmt(v, digits: int = 4) -> str:
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isnan(v) or (isinstance(v, np.floating) and np.isnan(v)):
        return ""
    if isinstance(v, (float, np.floating)):
        return f"{v:.0f}" if abs(v) >= 10 ** digits else f"{v:.{digits}g}"
    return str(v)


def format_frame(df: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    return df.apply(lambda s: s.map(lambda v: _fmt(v, digits))).astype(str)


def markdown(df: pd.DataFrame, title_text: str, note: str) -> str:
    f = format_frame(df)
    esc = [str(c).replace("|", "\\|") for c in f.columns]
    lines = [f"**{title_text}**", "", "| " + " | ".join(esc) + " |",
             "| " + " | ".join("---:" if pd.api.types.is_numeric_dtype(df[c]) else "---"
                               for c in df.columns) + " |"]
    for _, row in f.iterrows():
        lines.append("| " + " | ".join(v.replace("|", "\\|") for v in row) + " |")
    lines += ["", f"_{note}_", ""]
    return "\n".join(lines)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(s))


def latex(df: pd.DataFrame, title_text: str, note: str) -> str:
    f = format_frame(df)
    align = "".join("r" if pd.api.types.is_numeric_dtype(df[c]) else "l" for c in df.columns)
    lines = ["% written by experiments.plots from parquet records; needs \\usepackage{booktabs}",
             "\\begin{table}[t]", "\\centering", "\\footnotesize",
             f"\\caption{{{tex_escape(title_text)}}}", f"\\begin{{tabular}}{{{align}}}", "\\toprule",
             " & ".join(tex_escape(c) for c in f.columns) + " \\\\", "\\midrule"]
    for _, row in f.iterrows():
        lines.append(" & ".join(tex_escape(v) for v in row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", "",
              f"\\par\\smallskip{{\\scriptsize {tex_escape(note)}}}", "\\end{table}", ""]
    return "\n".join(lines)


def write_table(df: pd.DataFrame, out: Path, stem: str, title_text: str, note: str) -> list[Path]:
    """The table as Markdown (.md) and LaTeX (.tex, booktabs), with `note` under it."""
    out.mkdir(parents=True, exist_ok=True)
    df = df.reset_index(drop=True)
    md, tex = out / f"{stem}.md", out / f"{stem}.tex"
    md.write_text(markdown(df, title_text, note))
    tex.write_text(latex(df, title_text, note))
    return [md, tex]


# ---------------------------------------------------------------------------- shared tables
SYSTEM_ORDER = ["resident", "transformers", "lru", "lru_hybrid", "mo_sm", "quasi_hidden", "lru_s", "specmoeoff",
                "specmoeoff_tuned_k", "specmoe", "specmoe_tuned_k", "sp_e", "sp_l", "specter",
                "specter_hybrid", "host_experts", "host_experts_s", "fidelity"]
TUNED_SUFFIX = "_tuned_k"  # a system run at the profiled K instead of its own (spec.tune_own_k)


def tuned_apart(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of a system run with `spec.tune_own_k=true` (SpecMoEOff, SpecMoE at the profiled K
    instead of their own) named `<system>_tuned_k`, so tables and figures show them as a
    labelled system of their own beside the same system at its own K."""
    if "cfg.spec.tune_own_k" not in df:
        return df
    tuned = df["cfg.spec.tune_own_k"].map(lambda v: v is True or v == 1.0 or v == "true")
    if not tuned.any():
        return df
    df = df.copy()
    df.loc[tuned, "system"] = df.loc[tuned, "system"].astype(str) + TUNED_SUFFIX
    return df


def system_key(name) -> tuple[int, str]:
    name = str(name)
    return (SYSTEM_ORDER.index(name) if name in SYSTEM_ORDER else len(SYSTEM_ORDER), name)


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with `family`, `charged` and `engine` (derived where older records lack it)
    columns."""
    df = with_family(df)
    df["charged"] = charged(df)
    if "hardware" not in df:
        df["hardware"] = "-"
    df["engine"] = engines(df)
    return df


def palette(names) -> dict[str, str]:
    """A fixed colour per name (in order), so a system keeps its colour across panels."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def agg(df: pd.DataFrame, keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """Mean of each metric (NaN when no record has it) and the row count per key."""
    df = df.copy()
    for m in metrics:
        df[m] = pd.to_numeric(col(df, m), errors="coerce")
    keys = [k for k in keys if k in df]
    g = df.groupby(keys, dropna=False, sort=True)
    out = g[metrics].mean().reset_index() if metrics else g.size().reset_index()[keys]
    out["rows"] = g.size().values
    return out


def varying(t: pd.DataFrame, cols: list[str]) -> list[str]:
    """The columns among `cols` that take more than one value (others go in the note);
    `charged` only when it varies within a model (it follows from the model otherwise)."""
    def varies(c: str) -> bool:
        if c == "charged" and "model" in t:
            return bool((t.groupby("model")[c].agg(lambda s: s.astype(str).nunique()) > 1).any())
        return t[c].astype(str).nunique() > 1
    return [c for c in cols if c in t and varies(c)]


def slug(*parts) -> str:
    s = "_".join(str(p) for p in parts if p is not None and str(p) != "")
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in s)
