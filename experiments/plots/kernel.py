"""INT4 kernel microbenchmark (experiment `kernel`, `python -m experiments.kernel_bench`): one
MoE layer's routed experts per shape, ms against tokens per backend; measured rows (wall clock
on the machine that ran them) beside the cost model's charge for the same routing on the
modelled A100 (virtual clock). Figure: one panel per shape, solid lines measured, dashed
modelled. Table: each measured row with the modelled time of the same work beside it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.plots.base import (Result, clock_note, save_figure, subplots, title,
                                    write_table)

NAME = "kernel"
SHAPE_ORDER = ["deepseek", "qwen", "phi"]
BACKEND_ORDER = ["triton", "int4_per_expert", "cpu_int4", "reference", "target_serial",
                 "target_grouped"]
COLORS = {"triton": "tab:red", "int4_per_expert": "tab:orange", "cpu_int4": "tab:orange",
          "reference": "tab:brown", "target_serial": "tab:blue", "target_grouped": "tab:green"}
DTYPE_MARKERS = {"int4": "s", "float32": "o", "bfloat16": "^", "float16": "v"}
# The modelled row that charges the same work as a measured backend.
MODELLED_AS = {"triton": "triton", "cpu_int4": "int4_per_expert", "reference": "int4_per_expert",
               "target_serial": "target_serial", "target_grouped": "target_grouped"}
KEY = ["shape", "tokens", "backend", "dtype", "hardware", "device", "clock"]


def _order(values, order) -> list:
    return sorted(values, key=lambda v: (order.index(v) if v in order else len(order), str(v)))


def _col(df: pd.DataFrame, name: str, default) -> pd.Series:
    col = df[name] if name in df else pd.Series(default, index=df.index)
    # a text default into a numeric or all-missing column: object first (pandas 4 refuses it)
    return col.astype(object) if isinstance(default, str) and col.dtype != object else col


def normalise(df: pd.DataFrame) -> pd.DataFrame:
    """The columns this module reads, filled where older or partial records lack them."""
    df = df.copy()
    for name, default in (("clock", "wall"), ("hardware", "-"), ("device", "-"), ("dtype", "-"),
                          ("top_k", "?"), ("repeats", 0), ("note", ""), ("shape", "-")):
        df[name] = _col(df, name, default).fillna(default)
    df["ms"] = pd.to_numeric(_col(df, "ms", float("nan")), errors="coerce")
    for name in ("ms_p10", "ms_p90"):
        df[name] = pd.to_numeric(_col(df, name, float("nan")), errors="coerce").fillna(df["ms"])
    status = _col(df, "status", None)
    df["status"] = status.where(status.notna(), df["clock"].map(
        lambda c: "modelled" if c == "virtual" else "ok"))
    return df


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (shape, tokens, backend, dtype, hardware, device, clock): of several
    settings (e.g. --quick and a full run) the one with the most timed calls."""
    df = df.copy()
    df["_n"] = pd.to_numeric(_col(df, "repeats", 0), errors="coerce").fillna(0)
    df["_ok"] = _col(df, "status", "ok").isin(["ok", "modelled"])
    df = df.sort_values(["_ok", "_n"], ascending=False)
    return df.drop_duplicates(KEY).drop(columns=["_n", "_ok"])


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = latest(df)
    measured = df[df["clock"] != "virtual"].copy()
    modelled = df[df["clock"] == "virtual"]
    mod = modelled[["shape", "tokens", "backend", "ms", "hardware"]].rename(
        columns={"backend": "modelled_as", "ms": "model_ms", "hardware": "model_hw"})
    measured["modelled_as"] = measured["backend"].map(MODELLED_AS)
    t = measured.merge(mod, on=["shape", "tokens", "modelled_as"], how="left")
    # Modelled work no measured row stands beside (e.g. everything when only the model ran).
    matched = set(zip(t["shape"], t["tokens"], t["modelled_as"]))
    mask = pd.Series([(s, n, b) not in matched for s, n, b in
                      zip(modelled["shape"], modelled["tokens"], modelled["backend"])],
                     index=modelled.index, dtype=bool)
    alone = modelled.loc[mask]
    alone = alone.assign(modelled_as=alone["backend"], model_ms=alone["ms"],
                         model_hw=alone["hardware"], ms=float("nan"), ms_p10=float("nan"),
                         ms_p90=float("nan"), hardware="-", device="-", status="-", repeats=0,
                         backend="-", dtype="-")
    t = pd.concat([t, alone], ignore_index=True)
    t["_s"] = t["shape"].map(lambda v: _order(t["shape"].unique(), SHAPE_ORDER).index(v))
    t["_b"] = t["modelled_as"].map(lambda v: BACKEND_ORDER.index(v) if v in BACKEND_ORDER else 99)
    t = t.sort_values(["_s", "tokens", "_b", "backend", "dtype"]).reset_index(drop=True)
    for c in ("top_k", "repeats", "status", "device", "hardware"):
        t[c] = _col(t, c, "-")
    return t


def render(df: pd.DataFrame, out: Path) -> list[Path]:
    df = normalise(df)
    t = table(df)
    cols = {"shape": "shape", "tokens": "T", "top_k": "top-k", "backend": "backend",
            "dtype": "dtype", "ms": "measured ms", "ms_p10": "p10", "ms_p90": "p90",
            "repeats": "n", "status": "status", "hardware": "measured on",
            "model_ms": "A100 model ms", "modelled_as": "modelled as"}
    notes = sorted({str(n) for n in _col(latest(df), "note", "").dropna()
                    if str(n) and not str(n).startswith("CostModel")})
    devices = sorted({str(d) for d in _col(df[df["clock"] != "virtual"], "device", "-").dropna()})
    note = (clock_note(df, paper_numbers=False) + ". Measured: wall clock (median of n timed "
            f"calls, 10th/90th percentiles) on {', '.join(devices) or '-'}; A100 model: the "
            "virtual clock's CostModel (hardware=a100_pcie4_ideal, the real model's charged sizes) "
            "for the same routing ('int4_per_expert': its fused-kernel formula one expert at a "
            "time). "
            "One MoE layer's routed experts, random weights, seeded random routing."
            + ("" if not notes else " Not timed: " + " / ".join(notes) + "."))
    paths = write_table(t[list(cols)].rename(columns=cols), out, NAME,
                        "INT4 draft experts and FP target experts per MoE layer: measured and "
                        "modelled", note)

    d = latest(df)
    d = d[d["ms"].notna()]
    shapes = _order(d["shape"].unique(), SHAPE_ORDER)
    fig, axes = subplots(max(1, len(shapes)), ncols=3, w=5.0, h=3.8)
    for ax, shape in zip(axes, shapes):
        g = d[d["shape"] == shape]
        keys = g[["backend", "dtype", "hardware", "clock"]].drop_duplicates()
        order = lambda k: (k[3] == "virtual", BACKEND_ORDER.index(k[0])  # noqa: E731
                           if k[0] in BACKEND_ORDER else 99, k[1])
        for backend, dtype, hw, clock in sorted(keys.itertuples(index=False), key=order):
            s = g[(g["backend"] == backend) & (g["dtype"] == dtype) & (g["hardware"] == hw)
                  & (g["clock"] == clock)].sort_values("tokens")
            virtual = clock == "virtual"
            label = f"{backend} {dtype} - {'A100 model' if virtual else hw} ({clock})"
            ax.plot(s["tokens"], s["ms"], label=label, color=COLORS.get(backend, "gray"),
                    marker=DTYPE_MARKERS.get(dtype, "o"), linestyle="--" if virtual else "-",
                    alpha=0.75 if virtual else 1.0, markersize=5)
            if not virtual and len(s) and {"ms_p10", "ms_p90"} <= set(s):
                ax.fill_between(s["tokens"], s["ms_p10"], s["ms_p90"], alpha=0.15,
                                color=COLORS.get(backend, "gray"))
        ticks = sorted(g["tokens"].unique())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(int(v)) for v in ticks])
        top_k = g["top_k"].iloc[0] if "top_k" in g and len(g) else "?"
        dims = (f", {int(g['hidden'].iloc[0])}x{int(g['inter'].iloc[0])}"
                if {"hidden", "inter"} <= set(g) and g[["hidden", "inter"]].iloc[0].notna().all()
                else "")
        ax.set_title(f"{shape}{dims}, top-{top_k}", fontsize=9)
        ax.set_xlabel("tokens in the forward (1: draft step, K+1: verification)")
        ax.set_ylabel("ms per MoE layer")
        ax.grid(alpha=0.3, which="both")
    # One legend for all panels, right of the last one (series repeat across shapes).
    seen: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        axes[-1].legend(seen.values(), seen.keys(), fontsize=7, loc="upper left",
                        bbox_to_anchor=(1.01, 1.0))
    title(fig, "Routed experts of one MoE layer: solid = measured (wall clock), "
               "dashed = modelled A100 (virtual clock)", d if len(d) else df, paper_numbers=False)
    paths += save_figure(fig, out, NAME)
    return paths


RESULTS = [Result(name=NAME, experiment="kernel", render=render)]
