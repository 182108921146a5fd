"""Independent anchors: the virtual clock's offloaded decoding beside publications other than
the Specter paper, each run in the setting the publication states.

    python -m experiments.anchors OUT [--engines ideal,hf] [--items 3] [--tokens 48]
                                      [--datasets gsm8k] [--source TEXT] [--table-only]

1. Runs every row's setting (resumable: records already under OUT/records are skipped) on the
   publication's GPU as a profile of each engine kind (conf/hardware/<gpu>_ideal.yaml, an
   optimised engine; <gpu>_hf.yaml, an eager one): a project-made model of the real model's
   shape (small_mixtral for Mixtral-8x7B, small_deepseek for DeepSeek-V2-Lite, small_qwen3 for
   Qwen3-30B-A3B) with the real model's sizes charged at the publication's bits.
2. Writes OUT/anchors.md and OUT/anchors.parquet in the validation table's form (`quantity,
   model, system, profile, paper, ours, ratio, note`, `paper` being the publication's number)
   plus `source` (publication, table or figure) and `kind`: `absolute` (a published number)
   or `within` (a ratio of two numbers of one publication, e.g. full algorithm / accelerate,
   which does not depend on the engine's absolute speed); and the median |log ratio| per
   source, kind and engine. `python -m experiments.validate` appends these rows to its table
   when they are recorded in its tree.

Where a publication is silent (batch size, PCIe generation, cache size) the row's note says
what is assumed; docs/anchors.md says what each source states. A ratio far from 1 is a finding
(ARTIFACT.md, A.6, and docs/anchors.md), never a number to tune: nothing here feeds any profile.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from experiments.cases import Case, override_value, run_cases, table_cli, workload_overrides

ENGINES = ("ideal", "hf")

MO = "Mixtral-offloading (Eliseev & Mazur, arXiv 2312.17238), Table 2"
MI = "MoE-Infinity README, performance table (github EfficientMoE/MoE-Infinity)"
SE = "Speculating Experts (arXiv 2603.19289), TPOT breakdown and prefetch results"
KT = "kTransformers v0.3 AMX doc (github kvcache-ai/ktransformers doc/en/AMX.md @89823ccb)"
IK = ("ik_llama.cpp (a llama.cpp fork), its author's runs on a Ryzen-7950X + RTX-4080 "
      "(github ikawrakow/ik_llama.cpp PR #232, issue #490)")

REAL = {"small_mixtral": "Mixtral-8x7B", "small_deepseek": "DeepSeek-V2-Lite",
        "small_qwen3": "Qwen3-30B-A3B"}

# Mixtral-offloading's HQQ deployment (its demo notebook's BaseQuantizeConfig, dvmazur/
# mixtral-offloading demo.ipynb; the 3-bit one from the paper's text): attention 4-bit in groups
# of 64, experts 2-bit in groups of 16 (3-bit: groups of 64), every group's scale and zero
# quantized to 8 bits (2 bytes a group; the second-level scales, one per 128 or 256 groups, are
# under 0.1% of the bytes). Stored bits per weight: experts 3.02 (2-bit) and 3.75 (3-bit: HQQ
# packs 10 codes in 32 bits, so 64 codes take 7 words), attention 4.25. Charged here: 2-bit as
# 2 + 16/16 = 3.0 bits; 3-bit as 3 + 24/32 = 3.75 bits (groups of 32 at 3 bytes, the same bytes
# as HQQ's packing), which charges the attention 4.375 bits instead of 4.25 (+3% of 0.7 GB).
HQQ = {2: ("hardware.expert_bits=2", "hardware.quant_group=16", "hardware.quant_meta_bytes=2"),
       3: ("hardware.expert_bits=3", "hardware.quant_group=32", "hardware.quant_meta_bytes=3")}
HQQ_ATTN = ("hardware.attn_bits=4", "hardware.attn_quant_group=64")


def hqq(bits: int) -> tuple[str, ...]:
    return (*HQQ[bits], *HQQ_ATTN)


@dataclass(frozen=True)
class Run:
    """One setting, run once per engine profile of its GPU."""

    model: str
    system: str
    gpu: str  # conf/hardware/<gpu>_<engine>.yaml
    overrides: tuple[str, ...] = ()
    engines: tuple[str, ...] = ENGINES

    def case(self, engine: str) -> tuple[str, ...]:
        return (f"hardware={self.gpu}_{engine}", f"model={self.model}", f"system={self.system}",
                *self.overrides)


@dataclass(frozen=True)
class Anchor:
    """A published number and how ours is computed from our runs' mean TPOTs (ms)."""

    source: str
    kind: str  # absolute | within
    quantity: str
    model: str  # the real model
    system: str  # ours that stands for the publication's system
    gpu: str
    paper: float
    runs: tuple[Run, ...]
    value: Callable[..., float]  # the runs' mean TPOTs (ms), in order -> ours
    note: str = ""
    band: tuple[float, float] | None = None  # a published range, where the source gives one
    # False: not like for like (another model, or a number the text calls not comparable):
    # kept in the table, out of the medians
    matched: bool = True


def tok_s(tpot_ms: float) -> float:
    return 1e3 / tpot_ms


def s_token(tpot_ms: float) -> float:
    return tpot_ms / 1e3


def ratio_tok_s(a_ms: float, b_ms: float) -> float:
    """tokens/s of a over tokens/s of b."""
    return b_ms / a_ms


def tpot_ratio(a_ms: float, b_ms: float) -> float:
    """TPOT of a over TPOT of b."""
    return a_ms / b_ms


def saved(a_ms: float, base_ms: float) -> float:
    """The share of base's TPOT that a saves."""
    return 1.0 - a_ms / base_ms


# ------------------------------------------------------------------- Mixtral-offloading, Table 2
# GPU -> (k experts cached per layer, full 2-bit, full 3-bit, without pre-loading 2-bit,
# accelerate 2-bit, without LRU cache and pre-loading 2-bit, accelerate 3-bit), tokens per
# second. The 3060's accelerate 3-bit entry (1.791, above its 2-bit 0.919) reads as a typo in the
# source and is left out.
TABLE2 = {"a100_sxm_80g": (4, 3.061, 2.845, 2.918, 1.392, 2.265, 1.246),
          "rtx3080m": (4, 2.655, 2.475, 2.227, 1.059, 1.758, 0.914),
          "rtx3060": (2, 2.278, 2.038, 2.051, 0.919, 1.547, None),
          "t4": (4, 2.092, 1.603, 1.567, 0.661, 1.168, 0.580)}
TABLE2_NOTE = ("batch 1; OpenAssistant prompts sampled there, benchmark prompts greedy here; "
               "HQQ 4-bit attention; host CPU not stated (the profile's assumed host)")
TOP_K = ("budget=high", "budget.slots=2")  # Mixtral's top-2: the fewest slots a layer runs with
# Naive offloading "loads the entire MoE layer" every token on every GPU (the A100's 1.392
# tokens/s is what 32 layers x 8 experts over PCIe 4.0 take), so no experts module stays on the
# device: 5 GiB leaves 1.0 GiB after the reserve and Mixtral's 16-bit non-expert weights, less
# than one layer's experts (specter/budget.py resolve_gb).
NAIVE = ("budget=gb", "budget.gb=5")


def table2_runs(gpu: str) -> dict[str, Run]:
    k = TABLE2[gpu][0]
    slots = ("budget=high", f"budget.slots={k}")
    return {"full2": Run("small_mixtral", "mo_sm", gpu, (*slots, *hqq(2))),
            "full3": Run("small_mixtral", "mo_sm", gpu, (*slots, *hqq(3))),
            "lru2": Run("small_mixtral", "lru", gpu, (*slots, *hqq(2))),
            "acc2": Run("small_mixtral", "transformers", gpu, (*NAIVE, *hqq(2))),
            "none2": Run("small_mixtral", "lru", gpu, (*TOP_K, *hqq(2))),
            "acc3": Run("small_mixtral", "transformers", gpu, (*NAIVE, *hqq(3)))}


LABELS = {"full2": ("full algorithm, 2-bit experts", 1), "full3": ("full algorithm, 3-bit experts", 2),
          "lru2": ("without pre-loading, 2-bit experts", 3),
          "acc2": ("accelerate offload, 2-bit experts", 4),
          "none2": ("without LRU cache and pre-loading, 2-bit experts", 5),
          "acc3": ("accelerate offload, 3-bit experts", 6)}


def table2() -> list[Anchor]:
    out = []
    for gpu, row in TABLE2.items():
        runs = table2_runs(gpu)
        for key, (label, i) in LABELS.items():
            if row[i] is None:
                continue
            note = f"k = {row[0]} experts cached per layer; {TABLE2_NOTE}"
            if key == "none2":
                note = ("ours: LRU with top-2 slots per layer (it still hits where the next token "
                        f"reuses an expert; theirs keeps no cache); {TABLE2_NOTE}")
            elif key.startswith("acc"):
                note = ("accelerate's hooks move every layer's 8 experts each token (theirs: "
                        f"'loads the entire MoE layer'; ours: no experts module resident); {TABLE2_NOTE}")
            if key in ("full3", "acc3") and gpu == "t4":
                note += "; their 3-bit T4 runs used an Azure T4, the 2-bit ones Colab's"
            out.append(Anchor(MO, "absolute", f"tokens/s, {label}", "Mixtral-8x7B", runs[key].system,
                              gpu, row[i], (runs[key],), tok_s, note))
        for num, den, what in (("full2", "lru2", "full / without pre-loading (2-bit)"),
                               ("full2", "acc2", "full / accelerate (2-bit)"),
                               ("lru2", "none2", "without pre-loading / without cache and pre-loading (2-bit)"),
                               ("full2", "full3", "2-bit / 3-bit experts (full)")):
            p = row[LABELS[num][1]] / row[LABELS[den][1]]
            out.append(Anchor(MO, "within", f"speed ratio, {what}", "Mixtral-8x7B", runs[num].system,
                              gpu, p, (runs[num], runs[den]), ratio_tok_s))
    for key in ("full2", "lru2", "acc2"):
        i = LABELS[key][1]
        a, t = table2_runs("a100_sxm_80g")[key], table2_runs("t4")[key]
        out.append(Anchor(MO, "within", f"speed ratio A100 / T4, {LABELS[key][0]}", "Mixtral-8x7B",
                          a.system, "a100_sxm_80g/t4", TABLE2["a100_sxm_80g"][i] / TABLE2["t4"][i],
                          (a, t), ratio_tok_s))
    return out


# -------------------------------------------------------------------------- MoE-Infinity README
MI_NOTE = ("RTX A5000 24 GB, the dev branch's table (61840f5; main's d6178017 lists other "
           "DeepSeek numbers); the README states neither batch size, PCIe generation, dtype nor "
           "vLLM's flags: assumed batch 1, PCIe 4.0 x16 (the card's link), 16-bit weights")
A5000 = ("budget=gb", "budget.gb=24")


def moe_infinity() -> list[Anchor]:
    g = "rtx_a5000"
    acc_ds = Run("small_deepseek", "transformers", g, A5000)
    acc_mx = Run("small_mixtral", "transformers", g, A5000)
    mo_mx = Run("small_mixtral", "mo_sm", g, ("budget=high", "budget.slots=4", *hqq(2)))
    # Its mixtral-offloading number is 3.7-5.3x slower than that publication's own Table 2 on
    # comparable GPUs, from code and settings the README does not name: not compared (kept in
    # the table, out of the medians)
    mo_off = ("not compared: 3.7-5.3x slower than Mixtral-offloading's own Table 2 on comparable "
              "GPUs, from code and settings the README does not name "
              "(docs/measurements/anchors-2026-12-01); ")
    vl = {m: Run(m, "vllm_offload", g, A5000, engines=("ideal",))
          for m in ("small_deepseek", "small_mixtral", "small_qwen3")}
    out = [Anchor(MI, "absolute", "s/token, Accelerate", "DeepSeek-V2-Lite", "transformers", g, 1.743,
                  (acc_ds,), s_token, MI_NOTE),
           Anchor(MI, "absolute", "s/token, Accelerate", "Mixtral-8x7B", "transformers", g, 6.633,
                  (acc_mx,), s_token, MI_NOTE),
           Anchor(MI, "absolute", "s/token, mixtral-offloading", "Mixtral-8x7B", "mo_sm", g, 1.752,
                  (mo_mx,), s_token, mo_off + "assumed its released deployment: HQQ 2-bit "
                  f"experts, 4-bit attention, 4 experts cached per layer; {MI_NOTE}", matched=False)]
    for m, v in (("small_deepseek", 0.149), ("small_mixtral", 2.137), ("small_qwen3", 0.205)):
        out.append(Anchor(MI, "absolute", "s/token, vLLM 0.8.5 (cpu_offload_gb)", REAL[m],
                          "vllm_offload", g, v, (vl[m],), s_token,
                          f"ideal profile only (vLLM's engine); {MI_NOTE}"))
    out += [Anchor(MI, "within", "speed ratio vLLM / Accelerate", "DeepSeek-V2-Lite", "vllm_offload", g,
                   1.743 / 0.149, (vl["small_deepseek"], acc_ds), ratio_tok_s,
                   "ours: vLLM on the ideal profile over Accelerate on each profile"),
            Anchor(MI, "within", "speed ratio mixtral-offloading / Accelerate", "Mixtral-8x7B", "mo_sm",
                   g, 6.633 / 1.752, (mo_mx, acc_mx), ratio_tok_s, mo_off, matched=False),
            Anchor(MI, "within", "speed ratio mixtral-offloading / vLLM", "Mixtral-8x7B", "mo_sm",
                   g, 2.137 / 1.752, (mo_mx, vl["small_mixtral"]), ratio_tok_s,
                   mo_off + "ours: vLLM on the ideal profile", matched=False)]
    return out


# --------------------------------------------------------------- Speculating Experts (seed 002)
# On-demand loading: every routed expert on the host, the device holding one layer's top-k
# (budget.slots = top-k = 8, the fewest a layer can run with); prefetch: layer l+1's experts
# guessed from layer l's quasi-hidden state, copied on a second stream (ours waits for the
# true experts, theirs executes the guessed ones).
SE_SLOTS = ("budget=high", "budget.slots=8")
SE_GPUS = {"rtx_a6000": ((0.09, 0.14), "9-14% on the A6000 (Qwen3-30B-A3B)", None),
           "a100_sxm_80g": ((0.0, 0.08), "at most 5-8% on an A100 or GH200", "GPT-OSS-120B"),
           "gh200": ((0.0, 0.08), "at most 5-8% on an A100 or GH200", "Qwen3-235B-A22B")}
SE_NOTE = ("batch 1, 32 generated tokens; their inputs are 1024-65536 tokens, ours 16 (the KV "
           "reads of a 1024-token input add about 0.1 ms a token on these GPUs); their on-demand "
           "path keeps no expert from one token to the next, our LRU of top-k slots keeps what the "
           "next token reuses")


def speculating_experts() -> list[Anchor]:
    out = []
    for g, (band, said, theirs) in SE_GPUS.items():
        res = Run("small_qwen3", "resident", g, SE_SLOTS)
        lru = Run("small_qwen3", "lru", g, SE_SLOTS)
        pre = Run("small_qwen3", "quasi_hidden", g, SE_SLOTS)
        other = (f"theirs ran {theirs} on this GPU, ours Qwen3-30B-A3B's sizes (no stand-in for "
                 f"{theirs}): the link's effect, not a like-for-like check, left out of the "
                 "medians; ") if theirs else ""
        if g == "rtx_a6000":
            out.append(Anchor(SE, "within", "copy share of TPOT under on-demand loading",
                              "Qwen3-30B-A3B", "lru", g, 0.86, (res, lru), saved,
                              "ours: 1 - TPOT(resident) / TPOT(lru); published about 84-88%; "
                              + SE_NOTE, band=(0.84, 0.88)))
        lo, hi = 1.0 - band[1], 1.0 - band[0]  # TPOT(prefetch) / TPOT(on demand)
        out.append(Anchor(SE, "within", "TPOT with next-layer prefetch / TPOT on demand",
                          theirs or "Qwen3-30B-A3B", "quasi_hidden", g, (lo + hi) / 2, (pre, lru),
                          tpot_ratio,
                          other + f"published: prefetch saves {said}, a ratio of {lo:.2f}-{hi:.2f} "
                          "(paper value here: its middle); theirs runs the guessed experts (lossy), "
                          "ours waits for the true ones; " + SE_NOTE, band=(lo, hi),
                          matched=theirs is None))
    return out


# --------------------------------------------------------------- kTransformers (CPU experts)
# The one published decode speed found with every routed expert on the host beside one GPU, for
# a model this harness has (docs/measurements/host-anchors-sources-2026-12-03.md): Qwen3-30B-A3B,
# an RTX 4090, a Core i9-14900KF with 2 x DDR5-4000, "4-bit", one request: 12.0 tokens/s. Its
# "Xeon 4" rows (49.8 and 33 tokens/s) name no memory channels, so no host profile: left out.
KT_NOTE = ("experts computed on the CPU at decode (the serve rules' generate_device: cpu); "
           "'4-bit' as stated (the kernel's format not stated: 4 bits + a scale per 64 here); "
           "prompt and output lengths not stated; kTransformers captures CUDA graphs: ideal engine only")


def ktransformers() -> list[Anchor]:
    run = Run("small_qwen3", "host_experts", "rtx4090",
              ("budget=high", "host=i9_14900kf_ddr5_2ch", "hardware.expert_bits=4"),
              engines=("ideal",))
    return [Anchor(KT, "absolute", "tokens/s, one request, 4-bit, i9-14900KF (2 x DDR5-4000)",
                   "Qwen3-30B-A3B", "host_experts", "rtx4090", 12.0, (run,), tok_s, KT_NOTE)]


# ---------------------------------------------------- ik_llama.cpp (CPU experts, llama-bench)
# The llama.cpp family's way to run a model larger than the GPU: every layer on the GPU (-ngl),
# then the routed experts' tensors overridden back to the CPU (-ot "exps=CPU"; mainline's later
# --cpu-moe), so the CPU computes every routed expert and the GPU the rest. The fork's author
# published llama-bench rows of exactly that for two models this harness has, on one desktop
# (docs/measurements/host-anchors-2026-12-04.md): tg128, 128 new tokens after an empty prompt,
# batch 1. Precision as run: the GGUF file's bits per weight, from its stated size over its
# stated weights, charged as 4 bits plus a group's metadata (hardware.expert_bits takes 2, 3,
# 4 or 8; the metadata bytes make up the fraction).
IK_NOTE = ("every routed expert on the CPU (-ngl 99/100 -ot exps=CPU), attention and shared "
           "experts on the GPU; llama-bench tg128: 128 new tokens, empty prompt (ours: the "
           "anchors' workload); an optimised engine: ideal only")


def ik_llama() -> list[Anchor]:
    host = ("budget=high", "host=ryzen7950x")
    # PR #232 (2025-02-24): `llama-bench -m deepseek_lite.gguf -p 512 -n 128 -t 16 -ngl 100 -rtr 1
    # -ot "\.ffn_.*_exps\.=CPU"`: deepseek2 16B Q4_K - Medium, 9.78 GiB, tg128 45.28 t/s (CPU
    # only: 28.70). 9.78 GiB x 8 / 15.71e9 weights = 5.35 bits; charged 4 + 11 bytes / 64 =
    # 5.375 for the experts and the attention (Q4_K_M's mix of Q4_K and Q6_K blocks). The GPU
    # is named in the author's issue #437 ("Ryzen-7950X CPU + 4080 GPU"), not in the PR.
    lite = Run("small_deepseek", "host_experts", "rtx4080",
               (*host, "hardware.expert_bits=4", "hardware.attn_bits=4", "hardware.quant_group=64",
                "hardware.quant_meta_bytes=11"), engines=("ideal",))
    # Issue #490 (2025-06-03, build 24c010b3): "Ryzen-7950X + RTX-4080 ... leaving all experts on
    # the CPU (-ot exps=CPU)": qwen3moe IQ4_K_R4 - 4.5 bpw, 17.57 GiB, 30.53 B, -ngl 99, fa 1,
    # n_ubatch 1024, tg128 34.48 t/s. Experts a mix of IQ4_K_R4 and IQ5_K_R4, everything else
    # Q8_0: 4.94 bits a weight over the file; with the 1.5 B non-expert weights at 8.5 bits,
    # the experts' 29.0 B take 4.75: charged 4 + 3 bytes / 32 = 4.75, the attention 8 + 3 / 32
    # = 8.75 (Q8_0 is 8.5; the group's bytes are shared, and the attention is 3% of the weights).
    qwen3 = Run("small_qwen3", "host_experts", "rtx4080",
                (*host, "hardware.expert_bits=4", "hardware.attn_bits=8", "hardware.quant_group=32",
                 "hardware.quant_meta_bytes=3"), engines=("ideal",))
    return [Anchor(IK, "absolute", "tokens/s, tg128, Q4_K_M (5.35 bits), Ryzen-7950X",
                   "DeepSeek-V2-Lite", "host_experts", "rtx4080", 45.28, (lite,), tok_s,
                   "the model file is 'deepseek_lite.gguf' (DeepSeek-Lite, the author's name); "
                   "the GPU named in issue #437, not in PR #232; " + IK_NOTE),
            Anchor(IK, "absolute", "tokens/s, tg128, IQ4_K_R4/IQ5_K_R4 experts (4.75 bits), Ryzen-7950X",
                   "Qwen3-30B-A3B", "host_experts", "rtx4080", 34.48, (qwen3,), tok_s, IK_NOTE)]


def anchors(only: str | None = None) -> list[Anchor]:
    """Every row, or those whose source names one of `only`'s comma-separated words
    (case-insensitive)."""
    every = [*table2(), *moe_infinity(), *speculating_experts(), *ktransformers(), *ik_llama()]
    words = [w.strip().lower() for w in (only or "").split(",") if w.strip()]
    return [a for a in every if not words or any(w in a.source.lower() for w in words)]


def runs(engines=ENGINES, only: str | None = None) -> list[tuple[str, ...]]:
    """Every distinct case the anchors need, once."""
    seen: dict[tuple[str, ...], None] = {}
    for a in anchors(only):
        for r in a.runs:
            for e in r.engines:
                if e in engines:
                    seen.setdefault(r.case(e))
    return list(seen)


# ----------------------------------------------------------------------------------- the table
GROUPS = {"hardware": "hardware", "model": "model", "system": "system", "budget": "budget",
          "host": "cfg.hardware.host"}


def _select(df: pd.DataFrame, case: tuple[str, ...]) -> pd.DataFrame:
    """The records of one case (its overrides read back from the rows' configuration)."""
    keep = pd.Series(True, index=df.index)
    for o in case:
        key, _, value = o.partition("=")
        column = GROUPS.get(key, f"cfg.{key}")
        if column not in df:
            return df.iloc[0:0]
        v = override_value(value)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            keep &= pd.to_numeric(df[column], errors="coerce") == v
        else:
            keep &= df[column].astype(str) == str(v)
    return df[keep]


def _tpot(df: pd.DataFrame, case: tuple[str, ...]) -> float:
    v = pd.to_numeric(_select(df, case)["tpot_ms"], errors="coerce").dropna() if len(df) else []
    return float(v.mean()) if len(v) else math.nan


def table(df: pd.DataFrame, engines=ENGINES, only: str | None = None) -> pd.DataFrame:
    rows = []
    for a in anchors(only):
        for e in engines:
            if e != "ideal" and all(r.engines == ("ideal",) for r in a.runs):
                continue  # vLLM's rows: its engine is the ideal one
            # a run with only an ideal profile (vLLM) is read there beside either engine
            tp = [_tpot(df, r.case(e if e in r.engines else "ideal")) for r in a.runs]
            ours = math.nan if any(math.isnan(t) for t in tp) else a.value(*tp)
            ratio = ours / a.paper if a.paper and not math.isnan(ours) else math.nan
            note = a.note
            if a.band is not None and not math.isnan(ours):
                inside = a.band[0] <= ours <= a.band[1]
                note = f"inside the published range: {'yes' if inside else 'no'}; {note}"
            rows.append({"source": a.source, "kind": a.kind, "matched": a.matched, "quantity": a.quantity,
                         "model": a.model, "system": a.system,
                         "profile": "/".join(f"{g}_{e}" for g in a.gpu.split("/")),
                         "engine": e, "paper": a.paper, "ours": ours, "ratio": ratio, "note": note})
    return pd.DataFrame(rows)


def medians(t: pd.DataFrame) -> pd.DataFrame:
    """Median |log(ours / paper)| per source, kind and engine, over the like-for-like rows."""
    out = []
    t = t[t["matched"].astype(bool)] if "matched" in t else t
    for (source, kind, engine), g in t.groupby(["source", "kind", "engine"], sort=False):
        r = pd.to_numeric(g["ratio"], errors="coerce").dropna()
        r = r[r > 0]
        med = float(r.map(lambda v: abs(math.log(v))).median()) if len(r) else math.nan
        out.append({"source": source, "kind": kind, "engine": engine, "rows": len(r),
                    "median |log ratio|": med, "typical factor": math.exp(med) if len(r) else math.nan})
    return pd.DataFrame(out)


def write(out: Path, t: pd.DataFrame) -> list[Path]:
    from experiments.plots.base import markdown

    out.mkdir(parents=True, exist_ok=True)
    md, pq = out / "anchors.md", out / "anchors.parquet"
    note = ("ours: virtual clock, real models' sizes charged at the publication's bits, routing "
            "and tokens from the project-made models; ratio = ours / paper. `within` rows are "
            "ratios of two numbers of one publication.")
    md.write_text(markdown(medians(t), "Independent anchors: median |log(ours / paper)|", note)
                  + "\n" + markdown(t, "Independent anchors, one row per number", ""))
    t.to_parquet(pq, index=False)
    return [md, pq]


def main(argv: list[str] | None = None) -> int:
    ap = table_cli("python -m experiments.anchors", __doc__.splitlines()[0], 48, "comma-separated")
    ap.add_argument("--engines", default=",".join(ENGINES), help="ideal, hf or both")
    ap.add_argument("--source", default=None,
                    help="only the rows whose source names one of these, comma-separated "
                         "(e.g. ik_llama,kTransformers: the CPU-expert rows)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    engines = tuple(e for e in args.engines.split(",") if e)
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        print(f"error: unknown engine '{bad[0]}'; choose from {', '.join(ENGINES)}.", file=sys.stderr)
        return 2
    if not anchors(args.source):
        print(f"error: no anchor's source names '{args.source}'.", file=sys.stderr)
        return 2
    failed = 0
    if not args.table_only:
        todo = [Case((*c, f"dataset={ds}")) for ds in args.datasets.split(",")
                for c in runs(engines, args.source)]
        failed = run_cases(out, todo, workload_overrides(args), experiment="anchors")
    from experiments import records

    df = records.load(out)
    df = df[df["experiment"] == "anchors"] if "experiment" in df else df.iloc[0:0]
    if df.empty:
        print(f"error: no anchor records under {out}", file=sys.stderr)
        return 2
    t = table(df, engines, args.source)
    paths = write(out, t)
    with pd.option_context("display.width", 220, "display.max_columns", 20, "display.max_colwidth", 48):
        print(t.drop(columns=["note", "source"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print(medians(t).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
