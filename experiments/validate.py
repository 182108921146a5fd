"""The validation table: every number the paper publishes that this harness can produce, ours
beside the paper's, per engine profile.

    python -m experiments.validate OUT [--profiles a100_pcie4_ideal,a100_pcie4_hf]
                                       [--items 3] [--tokens 64] [--datasets gsm8k] [--table-only]

1. Runs the paper's cases (resumable: records already under OUT/records are skipped) on each
   profile: Specter, SpecMoEOff, MO-SM, Transformers and resident on the three project-made
   models at the high budget; Specter's ablation variants and its noisiest oracle case on the
   DeepSeek-shaped model; Specter at 16 / 24 / 32 GiB (`budget=gb`) for the hit-rate study;
   the routing fidelity of the INT4 draft (profile-independent); and the batch-32 case (Specter,
   SpecMoEOff, MO-SM, Transformers decoding 32 interleaved prompts together, `dataset=mix`).
2. Writes OUT/validation.md and OUT/validation.parquet with the columns
   `source, quantity, model, system, profile, paper, ours, ratio, note` (ratio = ours / paper),
   and the median absolute log-ratio per profile. Where `python -m experiments.anchors OUT` has
   recorded into the same tree, its rows (publications other than the Specter paper, each
   with its `source`) follow, with their medians per source, kind and engine.

The paper's numbers come from experiments/plots/paper.py (an A100 40 GB, PCIe 4.0 x16, real
models, means over five datasets); ours from the virtual clock with the real models' sizes
charged, on the project-made models' routing and tokens. A ratio far from 1 is a finding to
explain (ARTIFACT.md), not a number to tune: nothing here feeds back into any profile.
"""

from __future__ import annotations

import math
import sys
from dataclasses import fields
from pathlib import Path

import pandas as pd

from experiments import anchors  # its rows join this table; anchors does not import this
from experiments.cases import Case, override_value, run_cases, table_cli, workload_overrides
from experiments.plots import paper

MODELS = {"deepseek": "small_deepseek", "qwen": "small_qwen", "phi": "small_phi"}
PROFILES = ("a100_pcie4_ideal", "a100_pcie4_hf")
MAIN_SYSTEMS = ("resident", "specter", "specmoeoff", "mo_sm", "transformers", "vllm_offload")
IDEAL_ONLY = ("vllm_offload",)  # an optimised engine's system: run on the ideal profiles only
HIT_RATE_GB = (16, 24, 32)
NOISE_HIGH = 0.75
DEPTHS = (4, 8, 16, 32)  # Specter's K swept per profile: the chosen K* = argmin mean TPOT
BATCH = 32  # the paper's batched case: DeepSeek-V2-Lite, 32 sequences together
BATCH_SYSTEMS = tuple(paper.BATCH32_DEEPSEEK)
# The `source` of this table's own rows (docs/paper-notes.md gives each number's place in the
# paper); rows of experiments.anchors carry their publication, table or figure.
SOURCE = "Specter paper (docs/paper-notes.md)"


def ablation_variants() -> dict[str, tuple[str, ...]]:
    """The paper's four ablation rows as our switches (plots.paper.ABLATION_MS)."""
    from specter.config import SystemConfig

    knobs = {f.name for f in fields(SystemConfig)}
    none = ["system.orchestrator=false", "system.shared=false", "system.reorder=false"]
    if "overlap" in knobs:  # the artifact's "none": serial demand loading
        none.append("system.overlap=false")
    return {"full": (), "no PIO": ("system.orchestrator=false",),
            "no PIO+SIC": ("system.orchestrator=false", "system.shared=false"),
            "none": tuple(none)}


def cases(profiles, models=MODELS) -> list[Case]:
    out: list[Case] = []
    for hw in profiles:
        for fam, model in models.items():
            for system in MAIN_SYSTEMS:
                if system in IDEAL_ONLY and not hw.endswith("_ideal"):
                    continue
                out.append(Case((f"hardware={hw}", f"model={model}", f"system={system}", "budget=high")))
            for k in DEPTHS:  # the paper's K of each model is the main case; these find K*
                out.append(Case((f"hardware={hw}", f"model={model}", "system=specter", "budget=high",
                                 f"spec.k={k}")))
        if "deepseek" in models:
            ds = models["deepseek"]
            for variant in ablation_variants().values():
                if variant:
                    out.append(Case((f"hardware={hw}", f"model={ds}", "system=specter", "budget=high",
                                     *variant)))
            out.append(Case((f"hardware={hw}", f"model={ds}", "system=specter", "budget=high",
                             f"system.prefetch_noise={NOISE_HIGH}")))
            for gb in HIT_RATE_GB:
                out.append(Case((f"hardware={hw}", f"model={ds}", "system=specter", "budget=gb",
                                 f"budget.gb={gb}")))
    for model in models.values():  # routing fidelity: no clock involved
        out.append(Case((f"hardware={profiles[0]}", f"model={model}", "system=fidelity", "budget=high")))
    return out


def batch_cases(profiles, models=MODELS) -> list[Case]:
    """The batch-32 case per profile (its own workload: 32 prompts of dataset=mix at once)."""
    if "deepseek" not in models:
        return []
    return [Case((f"hardware={hw}", f"model={models['deepseek']}", f"system={system}",
                  "budget=high", f"workload.batch={BATCH}", f"workload.items={BATCH}",
                  "dataset=mix"))
            for hw in profiles for system in BATCH_SYSTEMS]


# --------------------------------------------------------------------------------- the table
def _mean(df: pd.DataFrame, column: str) -> float:
    if df.empty or column not in df:
        return math.nan
    v = pd.to_numeric(df[column], errors="coerce").dropna()
    return float(v.mean()) if len(v) else math.nan


def _knob(df: pd.DataFrame, name: str, value):
    """Rows whose `system.<name>` is `value`; a record without it (a system that lacks the
    knob, or an older record) holds the default."""
    from specter.specter_recipe import SpecterConfig

    is_default = value == getattr(SpecterConfig(name="-"), name)
    col = f"cfg.system.{name}"
    if col not in df:
        return pd.Series(is_default, index=df.index)
    return (df[col].isna() & is_default) | (df[col] == value)


def _defaults(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of systems run with every knob at its default (no ablation, no noise)."""
    return _variant(df, ())


def _variant(df: pd.DataFrame, overrides: tuple[str, ...]) -> pd.DataFrame:
    from specter.specter_recipe import SpecterConfig  # the variants are Specter's ablations

    want = {f.name: getattr(SpecterConfig(name="-"), f.name) for f in fields(SpecterConfig)
            if f.name != "name"}
    for o in overrides:
        key, _, value = o.partition("=")
        want[key.split(".", 1)[1]] = override_value(value)
    keep = pd.Series(True, index=df.index)
    for k, v in want.items():
        keep &= _knob(df, k, v)
    return df[keep]


def table(df: pd.DataFrame) -> pd.DataFrame:
    rows: list[dict] = []

    def add(quantity, model, system, profile, paper_v, ours, note=""):
        ratio = ours / paper_v if paper_v and not (math.isnan(ours) or math.isnan(paper_v)) else math.nan
        rows.append({"source": SOURCE, "quantity": quantity, "model": model, "system": system,
                     "profile": profile, "paper": paper_v, "ours": ours, "ratio": ratio, "note": note})

    df = df[df["system"] != "fidelity"] if "system" in df else df
    size = pd.to_numeric(df["cfg.workload.batch"], errors="coerce").fillna(1) \
        if "cfg.workload.batch" in df else pd.Series(1, index=df.index)
    batched, df = df[size == BATCH], df[size == 1]  # the batch-32 case; the rest one at a time
    fam_of = {v: k for k, v in MODELS.items()}
    df = df.assign(family=df["model"].map(lambda m: fam_of.get(m, m)))
    fixed_k = pd.to_numeric(df["cfg.spec.k"], errors="coerce").notna() if "cfg.spec.k" in df \
        else pd.Series(False, index=df.index)
    sweep, df = df[fixed_k], df[~fixed_k]  # K sweep rows; the rest run at the paper's K
    sweep = sweep.assign(k_fixed=pd.to_numeric(sweep.get("cfg.spec.k", pd.Series(dtype=float)),
                                               errors="coerce"))
    for hw in sorted(df["hardware"].dropna().unique()):
        d = df[df["hardware"] == hw]
        high = _defaults(d[(d["budget"] == "high")])
        for fam in MODELS:  # the depth Specter would choose on this profile
            main = high[(high["family"] == fam) & (high["system"] == "specter")]
            kv = sweep[(sweep["hardware"] == hw) & (sweep["model"] == MODELS[fam])
                       & (sweep["system"] == "specter")]
            means = {float(k): _mean(g, "tpot_ms") for k, g in kv.groupby("k_fixed")}
            if len(main):
                means.setdefault(_mean(main, "k"), _mean(main, "tpot_ms"))
            means = {k: v for k, v in means.items() if not math.isnan(v)}
            best = min(means, key=lambda k: (means[k], k)) if means else math.nan
            add("chosen depth K* (argmin TPOT)", fam, "specter", hw, paper.CHOSEN_K[fam], best,
                "ours over K in " + ", ".join(f"{k:g}: {v:.1f} ms" for k, v in sorted(means.items())))
        spd = []
        ideal = _defaults(df[df["hardware"].astype(str).str.endswith("_ideal")
                             & (df["budget"] == "high")])
        for fam in MODELS:
            h = high[high["family"] == fam]
            tp = {s: _mean(h[h["system"] == s], "tpot_ms") for s in MAIN_SYSTEMS}
            for s in IDEAL_ONLY:  # every profile's table shows the ideal engine's number
                tp[s] = _mean(ideal[(ideal["family"] == fam) & (ideal["system"] == s)], "tpot_ms")
            for s, v in paper.TPOT_HIGH_MS.get(fam, {}).items():
                if s in tp:
                    add("TPOT at the high budget (ms)", fam, s, hw, v, tp[s],
                        "ours on the ideal profile (vLLM's engine)" if s in IDEAL_ONLY else "")
            pt = paper.TPOT_HIGH_MS.get(fam, {})
            if "specmoeoff" in pt:
                add("speedup of Specter over SpecMoEOff", fam, "specter", hw,
                    pt["specmoeoff"] / pt["specter"], tp["specmoeoff"] / tp["specter"])
            if "transformers" in pt:
                add("Transformers TPOT / Specter TPOT", fam, "specter", hw,
                    pt["transformers"] / pt["specter"], tp["transformers"] / tp["specter"])
            spd.append(tp["specmoeoff"] / tp["specter"])
            sp = h[h["system"] == "specter"]
            add("hidden fraction of H2D time", fam, "specter", hw, paper.H2D_HIDDEN_FRAC[fam],
                _mean(sp, "h2d_hidden_frac"))
            k = _mean(sp, "k")
            distinct = _mean(sp, "distinct_experts_per_forward")
            top_k = {"deepseek": 6, "qwen": 4, "phi": 2}[fam]
            if fam == "deepseek":
                add("distinct experts per layer, one verify forward", fam, "specter", hw,
                    paper.EXPLOSION_DEEPSEEK[16], distinct,
                    f"ours: mean over verify forwards at K={k:g} (the last windows are shorter)")
            add("working-set growth, 1 -> K+1 tokens (x)", fam, "specter", hw,
                paper.EXPLOSION_GROWTH_1_TO_16[fam], distinct / top_k,
                f"paper: K=16; ours: K={k:g}" + ("" if k == 16 else " (not like for like)"))
        spd = [s for s in spd if not math.isnan(s)]
        add("speedup over SpecMoEOff, mean of models", "all", "specter", hw,
            paper.SPEEDUP_VS_SPECMOEOFF["mean"], sum(spd) / len(spd) if spd else math.nan)
        add("speedup over SpecMoEOff, max of models", "all", "specter", hw,
            paper.SPEEDUP_VS_SPECMOEOFF["max"], max(spd) if spd else math.nan)
        acc = _mean(high[high["system"] == "specter"], "acceptance_rate")
        add("acceptance per draft token, mean", "all", "specter", hw, paper.ACCEPTANCE["mean"], acc)
        # Ablation and robustness, DeepSeek-shaped model.
        ds = d[(d["family"] == "deepseek") & (d["budget"] == "high") & (d["system"] == "specter")]
        by_name = {name: ms for name, ms in paper.ABLATION_MS.values()}
        for name, ov in ablation_variants().items():
            add(f"ablation: {name} (ms/token)", "deepseek", "specter", hw, by_name[name],
                _mean(_variant(ds, ov), "tpot_ms"))
        lo = _mean(_variant(ds, ()), "tpot_ms")
        hi = _mean(_variant(ds, (f"system.prefetch_noise={NOISE_HIGH}",)), "tpot_ms")
        p_lo, p_hi = paper.ROBUSTNESS["tpot_ms"]
        prec = (_mean(_variant(ds, ()), "prefetch_precision"),
                _mean(_variant(ds, (f"system.prefetch_noise={NOISE_HIGH}",)), "prefetch_precision"))
        add("robustness: TPOT, accurate prefetch (ms)", "deepseek", "specter", hw, p_lo, lo,
            f"paper: precision 1.0; ours: noise 0, precision {prec[0]:.2f}")
        add("robustness: TPOT, wrong prefetch (ms)", "deepseek", "specter", hw, p_hi, hi,
            f"paper: precision 0.41; ours: noise {NOISE_HIGH}, precision {prec[1]:.2f}")
        add("robustness: TPOT ratio wrong / accurate", "deepseek", "specter", hw, p_hi / p_lo, hi / lo)
        # Hit rate at 16/24/32 GiB.
        gb = _defaults(d[(d["family"] == "deepseek") & (d["budget"] == "gb") & (d["system"] == "specter")])
        paper_hr = {g: v for g, v in paper.HIT_RATE_DEEPSEEK.values()}
        for g in HIT_RATE_GB:
            r = gb[pd.to_numeric(gb.get("budget_gb", pd.Series(dtype=float)), errors="coerce") == g]
            slots = _mean(r, "budget_slots")
            add(f"hit rate at {g} GiB", "deepseek", "specter", hw, paper_hr[g], _mean(r, "hit_rate"),
                f"{slots:.0f} slots/layer; cap slots/distinct {_mean(r, 'hit_rate_cap'):.3f}; per "
                f"(token, expert) {_mean(r, 'hit_rate_tokens'):.3f}; plan recall "
                f"{_mean(r, 'plan_recall'):.3f}" if not math.isnan(slots) else "not run")
    # Batch 32, DeepSeek-shaped model: TPOT per sequence, batch throughput, their ratios.
    for hw in sorted(batched["hardware"].dropna().unique()):
        b = batched[(batched["hardware"] == hw) & (batched["model"] == MODELS["deepseek"])]
        per_batch = b.drop_duplicates(["system", "batch_id", "repeat"])
        tput = {s: _mean(per_batch[per_batch["system"] == s], "batch_tokens_per_s")
                for s in BATCH_SYSTEMS}
        for s, (p_tpot, p_tput) in paper.BATCH32_DEEPSEEK.items():
            add(f"batch {BATCH}: TPOT (ms)", "deepseek", s, hw, p_tpot,
                _mean(b[b["system"] == s], "tpot_ms"))
            add(f"batch {BATCH}: throughput (tokens/s)", "deepseek", s, hw, p_tput, tput[s],
                "committed tokens of the batch / its start-to-last-commit time")
        p_spec = paper.BATCH32_DEEPSEEK["specter"][1]
        for s, (_, p_tput) in paper.BATCH32_DEEPSEEK.items():
            if s != "specter":
                add(f"batch {BATCH}: throughput of Specter / {s}", "deepseek", "specter", hw,
                    p_spec / p_tput, tput["specter"] / tput[s])
    return pd.DataFrame(rows)


def profile_free(fid: pd.DataFrame) -> pd.DataFrame:
    """Numbers that no clock touches: routing fidelity and the memory saving."""
    rows = []
    fam_of = {v: k for k, v in MODELS.items()}
    for model, g in fid.groupby("model") if len(fid) else []:
        fam = fam_of.get(model)
        if fam in paper.FIDELITY_GPTQ4:
            ours = _mean(g, "fidelity_topk")
            rows.append({"source": SOURCE, "quantity": "routing fidelity, INT4 GPTQ top-k match", "model": fam,
                         "system": "fidelity", "profile": "-", "paper": paper.FIDELITY_GPTQ4[fam],
                         "ours": ours, "ratio": ours / paper.FIDELITY_GPTQ4[fam], "note": ""})
    from experiments.memory_table import rows as memory_rows

    m = paper.MEMORY_QWEN_12K
    for r in memory_rows(m["context"]):
        if r["model"] == "qwen" and r["budget"] == "high":
            for q, p, o in (("GPU memory, shared instance, Qwen 12K (GB)", m["shared_GB"], r["shared_GB"]),
                            ("GPU memory, two models, Qwen 12K (GB)", m["separate_GB"], r["separate_GB"]),
                            ("GPU memory saving of sharing, Qwen 12K", m["saving"], r["saving"])):
                rows.append({"source": SOURCE, "quantity": q, "model": "qwen", "system": "specter", "profile": "-",
                             "paper": p, "ours": o, "ratio": o / p,
                             "note": f"byte arithmetic at {r['slots']} slots/layer"})
    return pd.DataFrame(rows)


def median_abs_log_ratio(t: pd.DataFrame, by: str | list[str] = "profile") -> dict:
    """Median |log(ours / paper)| per profile (or per `by`, e.g. ["source", "profile"])."""
    out = {}
    for key, g in t.groupby(by):
        r = pd.to_numeric(g["ratio"], errors="coerce").dropna()
        r = r[r > 0]
        out[key] = float(r.map(lambda v: abs(math.log(v))).median()) if len(r) else math.nan
    return out


def wide(t: pd.DataFrame) -> pd.DataFrame:
    """One row per quantity: the paper's number, then ours and the ratio on each profile."""
    keys = ["quantity", "model", "system"]
    order = list(dict.fromkeys(tuple(r) for r in t[keys].itertuples(index=False)))
    out = pd.DataFrame(order, columns=keys)
    out["paper"] = [t[(t[keys] == list(k)).all(axis=1)]["paper"].iloc[0] for k in order]
    for prof in sorted(t["profile"].unique(), key=lambda p: (p == "-", p.endswith("_hf"), p)):
        g = t[t["profile"] == prof].set_index(keys)
        label = "ours" if prof == "-" else f"ours {prof}"
        out[label] = [g["ours"].get(k, math.nan) for k in order]
        out["ratio" if prof == "-" else f"ratio {prof}"] = [g["ratio"].get(k, math.nan) for k in order]
    return out


def write(out: Path, t: pd.DataFrame) -> list[Path]:
    from experiments.plots.base import markdown

    src = t["source"] if "source" in t else pd.Series(SOURCE, index=t.index)
    others, t = t[src != SOURCE], t[src == SOURCE]
    med = median_abs_log_ratio(t)
    note = ("paper: A100 40 GB, PCIe 4.0 x16, real models, means over five datasets. ours: virtual "
            "clock with the real models' sizes charged, routing and tokens from the project-made "
            "models (small_deepseek / small_qwen / small_phi). ratio = ours / paper. Median "
            "|log ratio| per profile: " + ", ".join(f"{k} {v:.3f} (x{math.exp(v):.2f})"
                                                   for k, v in med.items()))
    md = out / "validation.md"
    pq = out / "validation.parquet"
    out.mkdir(parents=True, exist_ok=True)
    text = (markdown(wide(t), "Validation: the paper's numbers beside ours, per profile", note)
            + "\n" + markdown(t, "The same, one row per number (with notes)", ""))
    if len(others):  # experiments.anchors' rows, recorded in the same tree
        text += "\n" + markdown(anchors.medians(others), "Independent anchors: median |log(ours / "
                                "publication)| per source, kind and engine", "experiments/anchors.py")
        text += "\n" + markdown(others, "Independent anchors (the `paper` column is the "
                                 "publication's number)", "")
    md.write_text(text)
    pd.concat([t, others], ignore_index=True).to_parquet(pq, index=False)
    return [md, pq]


def main(argv: list[str] | None = None) -> int:
    ap = table_cli("python -m experiments.validate", __doc__.splitlines()[0], 64,
                   "comma-separated; the paper averages five")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    args = ap.parse_args(argv)
    out = Path(args.out)
    profiles = tuple(p for p in args.profiles.split(",") if p)
    failed = 0
    if not args.table_only:
        common = workload_overrides(args)
        todo = [Case((*c.overrides, f"dataset={ds}")) for ds in args.datasets.split(",")
                for c in cases(profiles)]
        failed = run_cases(out, todo, common)
        batch_common = [f"workload.max_new_tokens={args.tokens}", "workload.repeats=1"]
        failed += run_cases(out, batch_cases(profiles), batch_common)
    from experiments import records

    df = records.load(out)
    if df.empty:
        print(f"error: no records under {out}", file=sys.stderr)
        return 2
    every = df
    df = df[df["experiment"] == "validate"]
    t = pd.concat([table(df[df["system"] != "fidelity"]), profile_free(df[df["system"] == "fidelity"])],
                  ignore_index=True)
    anchored = every[every["experiment"] == "anchors"]
    if len(anchored):  # python -m experiments.anchors OUT ran into this tree
        t = pd.concat([t, anchors.table(anchored)], ignore_index=True)
    paths = write(out, t)
    with pd.option_context("display.width", 220, "display.max_columns", 20, "display.max_colwidth", 60):
        print(t.drop(columns="note").to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for (source, hw), v in median_abs_log_ratio(t, ["source", "profile"]).items():
        print(f"median |log(ours/published)| {source}, {hw}: {v:.3f} (a typical factor of "
              f"{math.exp(v):.2f})")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
