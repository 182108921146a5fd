"""Framework costs of the engine profiles, fit to public measurements of batch-1 decoding.

`python -m specter.clock.calibration` prints the fit and checks it against the values in
conf/hardware/*.yaml (tests/test_calibration.py does the same). docs/calibration.md cites
every measurement used and says what each profile therefore reproduces.

The model (specter/clock/costmodel.py): one decode step of a resident model costs its
roofline (bytes at HBM bandwidth, FLOPs at the matrix rate, 5 us per kernel launch) plus
`layer_overhead_s` per decoder layer and `expert_overhead_s` per MLP call (each routed
expert, each shared-expert block, each dense MLP, each fused INT4 draft layer). The step time
is linear in the two overheads, so each measurement is one equation
    measured_s = roofline_s + layers * layer_overhead_s + mlp_calls * expert_overhead_s
and the fit is the least-squares solution over the measurements of an engine (exact with
two). The roofline is computed by the very `CostModel` methods the virtual clock charges, on
the measured model's shapes (written out below from their public configs), on the measured
GPU. The paper's own TPOTs are never used here.

The same arithmetic on one device's own timings (scripts/calibrate_gpu.py measures them and
writes the profile and the error table): the H2D latency and bandwidth fit, the eager engine's
framework costs from whole-layer timings (`fit_overheads`), the offload runtime's host cost
per MoE layer (`fit_offload_layer`), and the error table's rows (records summarized per
system, virtual over measured TPOT).
Owns: the public measurements and their fit, and these fits. Does not own: the cost model
(costmodel.py), measuring on a device or writing a profile (scripts/calibrate_gpu.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from specter.clock.costmodel import ChargedSizes, CostModel, HardwareProfile

# GPUs the measurements ran on (datasheet peaks). The A800 is the A100's export variant (same
# HBM2e and tensor cores; only NVLink differs). gpt-fast's A100 ran power-capped at 330 W, which
# lowers clocks, not HBM bandwidth, the bound of batch-1 decoding.
A100_80GB = HardwareProfile("a100_80gb", matrix_flops=312e12, mem_bandwidth_Bps=2.039e12,
                            launch_overhead_s=5e-6, h2d_bandwidth_Bps=31.5e9, h2d_latency_s=10e-6)
A100_40GB = replace(A100_80GB, name="a100_40gb", mem_bandwidth_Bps=1.555e12)
A800_80GB = replace(A100_80GB, name="a800_80gb")
H20_96GB = replace(A100_80GB, name="h20_96gb", matrix_flops=148e12, mem_bandwidth_Bps=4.0e12,
                   launch_overhead_s=4e-6)


@dataclass(frozen=True)
class Shapes:
    """A decoder's per-layer parameter counts, from its public config.json."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    heads: int
    head_dim: int
    kv_heads: int
    vocab: int
    dense_inter: int = 0  # dense MLP intermediate size (layers without experts)
    expert_inter: int = 0  # one routed expert's intermediate size
    shared_inter: int = 0  # all shared experts of a layer together, as one MLP
    experts: int = 0
    top_k: int = 0
    elem_bytes: int = 2  # 2: FP16/BF16 weights; 1: int8 (gpt-fast's int8 Mixtral)

    def sizes(self) -> ChargedSizes:
        h = self.hidden
        attn = 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim + 2 * h
        dense = self.layers - self.moe_layers
        return ChargedSizes(
            source=f"public config: {self.name}", elem_bytes=self.elem_bytes, attn_params=attn,
            router_params=self.experts * h, shared_params=3 * h * self.shared_inter,
            dense_mlp_params=3 * h * self.dense_inter, expert_params=3 * h * self.expert_inter,
            lm_head_params=self.vocab * h, kv_elems_per_token=2 * self.kv_heads * self.head_dim,
            heads=self.heads, head_dim=self.head_dim, attn_multiplier=float(self.layers),
            moe_multiplier=float(self.moe_layers), dense_multiplier=float(dense))

    def mlp_calls(self, every_expert: bool = False) -> int:
        """MLP calls per decode step: dense MLPs, shared blocks and the routed experts called
        (top-k, or all of them where the framework's loop visits idle experts too)."""
        dense = self.layers - self.moe_layers
        routed = self.experts if every_expert else self.top_k
        return dense + self.moe_layers * (routed + (1 if self.shared_inter else 0))


# The measured models (public config.json values).
LLAMA_7B = Shapes("LLaMA-7B class (Llama-2-7b / open_llama_7b)", layers=32, moe_layers=0,
                  hidden=4096, heads=32, head_dim=128, kv_heads=32, vocab=32000, dense_inter=11008)
QWEN2_7B = Shapes("Qwen/Qwen2-7B-Instruct", layers=28, moe_layers=0, hidden=3584, heads=28,
                  head_dim=128, kv_heads=4, vocab=152064, dense_inter=18944)
QWEN3_8B = Shapes("Qwen/Qwen3-8B", layers=36, moe_layers=0, hidden=4096, heads=32, head_dim=128,
                  kv_heads=8, vocab=151936, dense_inter=12288)
DEEPSEEK_MOE_16B = Shapes("deepseek-ai/deepseek-moe-16b", layers=28, moe_layers=27, hidden=2048,
                          heads=16, head_dim=128, kv_heads=16, vocab=102400, dense_inter=10944,
                          expert_inter=1408, shared_inter=2 * 1408, experts=64, top_k=6)
QWEN2_57B_A14B = Shapes("Qwen/Qwen2-57B-A14B-Instruct", layers=28, moe_layers=28, hidden=3584,
                        heads=28, head_dim=128, kv_heads=4, vocab=151936, expert_inter=2560,
                        shared_inter=20480, experts=64, top_k=8)
QWEN3_30B_A3B = Shapes("Qwen/Qwen3-30B-A3B", layers=48, moe_layers=48, hidden=2048, heads=32,
                       head_dim=128, kv_heads=4, vocab=151936, expert_inter=768, experts=128, top_k=8)
MIXTRAL_8X7B_INT8 = Shapes("mistralai/Mixtral-8x7B (int8 weights)", layers=32, moe_layers=32,
                           hidden=4096, heads=32, head_dim=128, kv_heads=8, vocab=32000,
                           expert_inter=14336, experts=8, top_k=2, elem_bytes=1)


@dataclass(frozen=True)
class Measurement:
    """One public batch-1 decode measurement (docs/calibration.md cites each)."""

    engine: str  # "hf" (eager framework) | "ideal" (optimised engine)
    use: str  # "fit": one equation of the fit | "check": held out, predicted and compared
    shapes: Shapes
    gpu: HardwareProfile
    tokens_per_s: float
    context: int  # typical KV length during the measured decode (prompt + half the output)
    source: str
    every_expert: bool = False  # the framework's MoE loop calls idle experts too

    @property
    def measured_s(self) -> float:
        return 1.0 / self.tokens_per_s


MEASUREMENTS = (
    # Eager frameworks (the *_hf profiles).
    Measurement("hf", "fit", DEEPSEEK_MOE_16B, A800_80GB, 14.73, 256,
                "deepseek-ai/DeepSeek-MoE issue 13 (A800-80G; framework not stated, HF inferred)"),
    Measurement("hf", "fit", LLAMA_7B, A100_80GB, 25.5, 100,
                "gpt-fast blog, eager starting point (A100-80GB at 330 W, batch 1)"),
    Measurement("hf", "fit", QWEN2_7B, A100_80GB, 37.97, 1024,
                "Qwen2 speed benchmark: HF transformers BF16, FlashAttention 2, batch 1, A100 80GB"),
    Measurement("hf", "fit", LLAMA_7B, A100_40GB, 41.32, 128,
                "litgpt PR 726: eager, bf16, open_llama_7b, A100-SXM4-40GB"),
    Measurement("hf", "check", QWEN3_8B, H20_96GB, 45.32, 1024,
                "Qwen3 speed benchmark: HF transformers 4.51.3 BF16, batch 1, H20"),
    Measurement("hf", "check", QWEN2_57B_A14B, A100_80GB, 4.76, 1024,
                "Qwen2 speed benchmark: HF transformers BF16, batch 1, 2x A100 80GB (layers split)",
                every_expert=True),
    Measurement("hf", "check", QWEN3_30B_A3B, H20_96GB, 1.89, 1024,
                "Qwen3 speed benchmark: HF transformers 4.51.3 (loop calls every expert), H20",
                every_expert=True),
    # Optimised engines (the *_ideal profiles).
    Measurement("ideal", "fit", QWEN2_7B, A100_80GB, 80.45, 1024,
                "Qwen2 speed benchmark: vLLM 0.4.2 BF16, batch 1, A100 80GB"),
    Measurement("ideal", "fit", LLAMA_7B, A100_80GB, 107.38, 100,
                "torchao README: gpt-fast-style compiled bf16 Llama-2-7B, A100-80GB"),
    Measurement("ideal", "fit", MIXTRAL_8X7B_INT8, A100_80GB, 97.92, 100,
                "gpt-fast README: compiled int8 Mixtral-8x7B on 1 A100-80GB (330 W)"),
    Measurement("ideal", "check", QWEN3_30B_A3B, H20_96GB, 137.18, 1024,
                "Qwen3 speed benchmark: SGLang 0.4.6 BF16, batch 1, H20"),
)


def decode_step(cost: CostModel, shapes: Shapes, context: int) -> float:
    """One resident decode step (1 token) charged as the virtual clock charges it."""
    s = cost.attention_s(1, context) + cost.lm_head_s(1)
    if shapes.layers > shapes.moe_layers:
        s += cost.dense_mlp_s(1)
    if shapes.moe_layers:
        s += cost.router_s(1) + cost.shared_s(1) + shapes.top_k * cost.expert_s(1)
    return s


def fit(measurements=MEASUREMENTS, engine: str = "hf") -> tuple[float, float, list[dict]]:
    """(layer_overhead_s, expert_overhead_s, rows): least squares over `engine`'s "fit"
    measurements of measured - roofline = layers * a + mlp_calls * b (a, b >= 0); every row
    (held-out "check" ones too) gets the fitted model's prediction."""
    rows, A, y = [], [], []
    for m in measurements:
        if m.engine != engine:
            continue
        roof = decode_step(CostModel(m.gpu, m.shapes.sizes()), m.shapes, m.context)
        calls = m.shapes.mlp_calls(m.every_expert)
        if m.use == "fit":
            A.append((m.shapes.layers, calls))
            y.append(m.measured_s - roof)
        rows.append({"engine": engine, "use": m.use, "model": m.shapes.name, "gpu": m.gpu.name,
                     "measured_ms": m.measured_s * 1e3, "roofline_ms": roof * 1e3,
                     "layers": m.shapes.layers, "mlp_calls": calls, "source": m.source})
    a, b = _nonneg_lstsq(A, y)
    for r in rows:
        r["fitted_ms"] = r["roofline_ms"] + (r["layers"] * rounded(a) + r["mlp_calls"] * rounded(b)) * 1e3
        r["fitted / measured"] = r["fitted_ms"] / r["measured_ms"]
    return a, b, rows


def _nonneg_lstsq(A: list[tuple[float, float]], y: list[float]) -> tuple[float, float]:
    """min |A x - y|^2 over x >= 0 for two unknowns (normal equations, then the boundary)."""
    if not A:
        return 0.0, 0.0
    saa = sum(a * a for a, _ in A)
    sbb = sum(b * b for _, b in A)
    sab = sum(a * b for a, b in A)
    say = sum(a * t for (a, _), t in zip(A, y))
    sby = sum(b * t for (_, b), t in zip(A, y))
    det = saa * sbb - sab * sab
    if abs(det) > 1e-12 * max(saa * sbb, 1e-30):
        x = ((sbb * say - sab * sby) / det, (saa * sby - sab * say) / det)
        if x[0] >= 0 and x[1] >= 0:
            return x
    cands = [(max(0.0, say / saa) if saa else 0.0, 0.0), (0.0, max(0.0, sby / sbb) if sbb else 0.0)]
    err = lambda x: sum((a * x[0] + b * x[1] - t) ** 2 for (a, b), t in zip(A, y))  # noqa: E731
    return min(cands, key=err)


def rounded(x: float) -> float:
    """The fitted value as the yaml stores it: 3 significant digits."""
    return float(f"{x:.3g}") if x else 0.0


# ------------------------------------------------------------------------------------------
# Fits on one device's own timings (scripts/calibrate_gpu.py measures them and writes the
# profile; these turn its numbers into the profile's values and its error table's rows)
# ------------------------------------------------------------------------------------------
def clamped(name: str, raw: float) -> dict:
    """A fitted cost `name` (a residual: measured minus what the model already charges),
    clamped at 0 where the roofline is above the measurement, beside its raw value
    (`<name>_raw_s`)."""
    return {name: max(0.0, raw), name.removesuffix("_s") + "_raw_s": raw}


def fit_latency_bandwidth(sizes: list[float], times: list[float],
                          relative: bool = True) -> tuple[float, float]:
    """Least-squares fit of t = latency + bytes / bandwidth -> (latency_s, bandwidth_Bps).

    relative=True weights each point by 1/t (minimises relative error), so the small copies
    that fix the latency count as much as the large ones that fix the bandwidth."""
    import numpy as np

    x, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ValueError("the fit needs at least two distinct sizes")
    w = 1.0 / t if relative else np.ones_like(t)
    a = np.stack([w, x * w], axis=1)  # rows [1, bytes] scaled by the weights
    (latency, inv_bw), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if not inv_bw > 0:
        raise ValueError(f"fitted seconds per byte is not positive ({inv_bw}); timings too noisy")
    return float(latency), float(1.0 / inv_bw)


def hardware_profile(vals: dict, name: str, overheads: bool = True) -> HardwareProfile:
    """A profile's values (the keys of conf/hardware/*.yaml) as the cost model's hardware; with
    `overheads=False` the bare roofline (no framework costs, engine "ideal")."""
    return HardwareProfile(name=name, matrix_flops=vals["matrix_flops"],
                           mem_bandwidth_Bps=vals["mem_bandwidth_Bps"],
                           launch_overhead_s=vals["launch_overhead_s"],
                           h2d_bandwidth_Bps=vals["h2d_bandwidth_Bps"],
                           h2d_latency_s=vals["h2d_latency_s"],
                           layer_overhead_s=vals["layer_overhead_s"] if overheads else 0.0,
                           expert_overhead_s=vals["expert_overhead_s"] if overheads else 0.0,
                           draft_overhead_s=vals.get("draft_overhead_s") if overheads else 0.0,
                           offload_layer_overhead_s=vals.get("offload_layer_overhead_s", 0.0)
                           if overheads else 0.0,
                           engine="hf" if overheads else "ideal")


def predicted_layer_s(cost: CostModel, T: int, context: int,
                      tokens_per_expert: list[int]) -> float:
    """What the cost model charges for one MoE decoder layer (multipliers 1)."""
    return (cost.attention_s(T, context) + cost.router_s(T) + cost.shared_s(T)
            + sum(cost.expert_s(n) for n in tokens_per_expert))


def fit_overheads(layer_s: float, expert_call_s: float, expert_roofline_s: float,
                  layer_rest_s: float, n_mlp_calls: int) -> dict:
    """The eager engine's framework costs from whole-step timings.

    The cost model charges one MoE decoder layer at T tokens and context C as
        attention_s   = projections roofline (6 launches) + KV read + layer_overhead_s
        router_s      = roofline (2 launches)
        shared_s      = roofline (3 launches) + expert_overhead_s           (one MLP call)
        expert_s(n_e) = roofline (3 launches) + expert_overhead_s, per routed expert hit
    (the real model's sizes, multipliers 1). Two unknowns, two measurements:
    - expert_overhead_s: `expert_call_s`, the eager cost of one more MLP call (slope of the HF
      eager experts loop timed with 1 and with top-k experts forced, same token), minus that
      call's roofline at the measured rates (`expert_roofline_s`).
    - layer_overhead_s: `layer_s`, the wall time one eager decoder layer adds to a T=1 decode
      step (a 3-layer minus a 1-layer model, so embedding, final norm, lm head and per-forward
      glue cancel), minus everything else the model charges for it: the rooflines of
      attention, router, shared and routed experts (`layer_rest_s`) plus `n_mlp_calls`
      (shared + routed) times the fitted expert_overhead_s.
    Negative residuals (the roofline above the measurement) are clamped to 0; the raw values
    are returned too."""
    expert = clamped("expert_overhead_s", expert_call_s - expert_roofline_s)
    layer_raw = layer_s - layer_rest_s - n_mlp_calls * expert["expert_overhead_s"]
    return {**expert, **clamped("layer_overhead_s", layer_raw)}


def summarize_records(df) -> dict[str, dict[str, float]]:
    """system -> {tpot_ms, hidden_frac, rows} (means over rows). With several repeats, repeat 0
    of every request is a warm-up (CUDA context, cuBLAS handles, Triton compiles) and dropped."""
    out: dict[str, dict[str, float]] = {}
    if df is None or len(df) == 0:
        return out
    if "repeat" in df and df["repeat"].max() > 0:
        df = df[df["repeat"] > 0]
    for system, g in df.groupby("system"):
        hidden = g["h2d_hidden_frac"].astype(float).mean() if "h2d_hidden_frac" in g else math.nan
        out[str(system)] = {"tpot_ms": float(g["tpot_ms"].astype(float).mean()),
                            "hidden_frac": float(hidden), "rows": int(len(g))}
    return out


def fit_offload_layer(real: dict, virtual: dict, moe_layers: int) -> dict | None:
    """The offload runtime's host cost per MoE layer per forward: what lru adds over resident
    in real time beyond what the virtual clock (without this cost) already charges it (its
    exposed copy waits), per MoE layer (both decode one token per forward). `real` and
    `virtual` are `summarize_records` outputs; None when a run is missing."""
    try:
        gap_ms = (real["lru"]["tpot_ms"] - real["resident"]["tpot_ms"]) \
            - (virtual["lru"]["tpot_ms"] - virtual["resident"]["tpot_ms"])
    except KeyError:
        return None
    raw = gap_ms / 1e3 / moe_layers
    return {**clamped("offload_layer_overhead_s", raw), "moe_layers": moe_layers, "gap_ms": gap_ms}


def error_rows(measured: dict, virtual: dict[str, dict], systems: list[str],
               notes: dict[tuple[str, str], str] | None = None) -> list[dict]:
    """Rows system x profile: measured (real clock) vs virtual TPOT and hidden H2D fraction.
    `measured` and each `virtual[profile]` are `summarize_records` outputs."""
    notes = notes or {}
    rows = []
    for profile, v in virtual.items():
        for s in systems:
            m, vv = measured.get(s, {}), v.get(s, {})
            mt, vt = m.get("tpot_ms", math.nan), vv.get("tpot_ms", math.nan)
            rows.append({"system": s, "profile": profile, "measured_tpot_ms": mt,
                         "virtual_tpot_ms": vt,
                         "ratio_virtual_over_measured": vt / mt if mt and mt > 0 else math.nan,
                         "measured_hidden_frac": m.get("hidden_frac", math.nan),
                         "virtual_hidden_frac": vv.get("hidden_frac", math.nan),
                         "note": notes.get((s, profile), "")})
    return rows


def main(argv: list[str]) -> int:
    import yaml

    conf = Path(__file__).resolve().parents[2] / "conf" / "hardware"
    bad = 0
    for engine, label in (("hf", "eager framework"), ("ideal", "optimised engine")):
        a, b, rows = fit(engine=engine)
        print(f"{label} ({engine}) fit, batch-1 decode, resident weights:")
        for r in rows:
            print(f"  [{r['use']:<5}] {r['model']:<44} {r['gpu']:<10} measured {r['measured_ms']:7.2f} ms "
                  f" roofline {r['roofline_ms']:6.2f}  fitted {r['fitted_ms']:7.2f} "
                  f"(x{r['fitted / measured']:.2f}; {r['layers']} layers, {r['mlp_calls']} MLP calls)")
        print(f"  layer_overhead_s = {rounded(a):.3g}   expert_overhead_s = {rounded(b):.3g}")
        for path in sorted(conf.glob(f"*_{engine}.yaml")):
            y = yaml.safe_load(path.read_text())
            ok = math.isclose(y["layer_overhead_s"], rounded(a)) and \
                math.isclose(y["expert_overhead_s"], rounded(b))
            bad += not ok
            print(f"  {path.name}: layer {y['layer_overhead_s']:.3g}, expert {y['expert_overhead_s']:.3g} "
                  f"{'(matches the fit)' if ok else '(DIFFERS from the fit)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
