#!/usr/bin/env python
"""Calibrate the virtual clock on a real device, write the measured hardware profile, and
measure how far the virtual clock is from real CUDA time.

    python scripts/calibrate_gpu.py --out DIR                 # on a CUDA GPU (scripts/gpu_check.sh)
    python scripts/calibrate_gpu.py --device cpu --quick      # smoke test on a CPU (tiny shapes)

Stages (each one in try/except: a failing stage writes its error and the next one runs):
  1 launch   per-kernel launch cost (tiny kernels, synchronized at the end), eager dispatch
             cost per op, and the device-side cost per kernel in a CUDA graph
  2 h2d      pinned host -> device copies, 64 KiB .. 256 MiB on a side stream (CUDA events);
             time = latency + bytes / bandwidth fitted by (relative) least squares
  3 hbm      device-to-device copy bandwidth, large GEMM rate, large GEMV weight bandwidth
  4 roles    per-role step times at T = 1 and T = K+1 at the real models' shapes (one routed
             expert, the attention projections, router, shared experts, lm head), the HF eager
             experts loop with 1..top-k experts, and whole eager decoder layers of the real
             architecture (random weights, DynamicCache of ~32 tokens); fits the engine's
             framework costs `layer_overhead_s` and `expert_overhead_s`
             (specter/clock/calibration.py `fit_overheads`)
  5 profile  hardware_measured.yaml (the keys of conf/hardware/h200_hf.yaml)
  6 table    run.py on the project-made model for resident / lru / specter: real CUDA time
             (hardware=cuda) against the virtual clock (charge=own) under the measured profile,
             h200_hf and h200_ideal -> error_table.md / .csv (repeat 0 of each request is a
             dropped warm-up). The model is built in the background during stages 3-5 if it is
             not cached ($SPECTER_CACHE); if that does not finish in time, tiny_deepseek instead.

Owns: these measurements and the files under --out (calibration.json with every raw number,
hardware_measured.yaml, error_table.*, logs). Keeps within --budget-s: later stages are
shortened or skipped when time runs out; what exists is always written. Does not own the fits
of the measured numbers (specter/clock/calibration.py), the cost model
(specter/clock/costmodel.py) or the runs (run.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from specter.clock.calibration import (clamped, error_rows, fit_latency_bandwidth,  # noqa: E402
                                         fit_offload_layer, fit_overheads, hardware_profile,
                                         predicted_layer_s, summarize_records)

KiB, MiB = 1 << 10, 1 << 20
DEEPSEEK_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # one DeepSeek-V2-Lite routed expert in fp16: 17.3 MB
# The keys of conf/hardware/h200_hf.yaml, in its order (HardwareConfig's fields).
PROFILE_KEYS = ("name", "device", "clock", "charge", "engine", "matrix_flops", "mem_bandwidth_Bps",
                "launch_overhead_s", "layer_overhead_s", "expert_overhead_s", "draft_overhead_s",
                "offload_layer_overhead_s", "h2d_bandwidth_Bps", "h2d_latency_s",
                "host_matrix_flops", "host_mem_bandwidth_Bps")
NUMERIC_KEYS = PROFILE_KEYS[5:]
# The virtual clocks compared: the measured profile without and with the fitted offload host
# cost (fit on lru vs resident; every other system's row under measured_fit is held out).
TABLE_PROFILES = ("measured", "measured_fit", "h200_hf", "h200_ideal")


class Terminated(BaseException):
    """SIGTERM (scripts/gpu_check.sh's `timeout`): stop, kill our children, write what exists."""


def _on_sigterm(signum, frame):
    raise Terminated()


# ======================================================================================
# the profile and the error table as files (the fits: specter/clock/calibration.py)
# ======================================================================================
def rows_markdown(rows: list[dict], title: str) -> str:
    cols = ["system", "profile", "measured_tpot_ms", "virtual_tpot_ms",
            "ratio_virtual_over_measured", "measured_hidden_frac", "virtual_hidden_frac", "note"]
    fmt = lambda v: (f"{v:.4g}" if isinstance(v, float) and not math.isnan(v)  # noqa: E731
                     else "-" if isinstance(v, float) else str(v))
    lines = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def profile_yaml(values: dict, sources: dict[str, str]) -> str:
    """The profile as yaml text with one comment per value saying where it came from."""
    lines = ["# Measured by scripts/calibrate_gpu.py (calibration.json holds every raw number).",
             f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"]
    for k in PROFILE_KEYS:
        v = values[k]
        text = f"{float(v):.4e}" if k in NUMERIC_KEYS else str(v)
        note = sources.get(k, "")
        lines.append(f"{k}: {text}" + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"


def load_profile_yaml(path: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def profile_numbers(y: dict) -> dict:
    """A profile yaml's numeric keys; one written before the draft and offload costs existed
    charges a draft layer as one MLP call and no offload host cost (HardwareConfig's defaults)."""
    y = dict(y)
    if y.get("draft_overhead_s") is None:
        y["draft_overhead_s"] = y["expert_overhead_s"]
    y.setdefault("offload_layer_overhead_s", 0.0)
    return {k: float(y[k]) for k in NUMERIC_KEYS}


def write_fitted_profile(ctx: "Ctx", vals: dict, base: Path | None) -> None:
    """hardware_measured.yaml under --out with the table's offload fit: the other values and
    their notes as in `base` (this run's or --profile's yaml), or this run's stages."""
    values = {"name": ctx.args.name, "device": "auto", "clock": "virtual", "charge": "auto",
              "engine": "hf", **vals}
    src = current_profile(ctx)[1]
    if base is not None:
        for line in base.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in NUMERIC_KEYS and "#" in rest:
                src[key] = rest.split("#", 1)[1].strip()
        if base.resolve() != (ctx.out / "hardware_measured.yaml").resolve():
            src.update({k: f"from {base}: {src[k]}" for k in NUMERIC_KEYS})
    off = ctx.stage("table").get("offload_fit", {})
    src["offload_layer_overhead_s"] = (f"fit: real {off.get('real_label')} lru - resident TPOT "
                                       "beyond the virtual clock's, per MoE layer (stage_table)")
    (ctx.out / "hardware_measured.yaml").write_text(profile_yaml(values, src))


# ======================================================================================
# timing
# ======================================================================================
class Clock:
    """Seconds per call on `device`: perf_counter around synchronized regions."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def pipelined(self, fn, iters: int, warmup: int = 2) -> float:
        """Mean seconds per call with one sync at the end (kernels queue back to back)."""
        for _ in range(warmup):
            fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / iters

    def synced(self, fn, iters: int, warmup: int = 2, between=None) -> float:
        """Median seconds per call, synchronized before and after each (a decode step)."""
        out = []
        for i in range(warmup + iters):
            if between is not None:
                between()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        out.sort()
        return out[len(out) // 2]


class Ctx:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.quick = args.quick
        self.dtype = {"auto": torch.float16 if self.cuda else torch.float32, "fp16": torch.float16,
                      "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        self.clock = Clock(self.device)
        self.t0 = time.monotonic()
        self.budget = args.budget_s
        self.out = Path(args.out).resolve()  # the runs below start in the repository root
        self.results: dict = {"meta": {}, "stages": {}}
        self.build = None  # background build of the table's model: (Popen, name, log file)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def stage(self, name: str) -> dict:
        return self.results["stages"].get(name, {})

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "calibration.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=_json_default))
        os.replace(tmp, self.out / "calibration.json")


def _json_default(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return str(v)


def _fallbacks() -> dict:
    """Values of the stock h200 profiles, for what a stage could not measure."""
    conf = REPO / "conf" / "hardware"
    ideal, hf = load_profile_yaml(conf / "h200_ideal.yaml"), load_profile_yaml(conf / "h200_hf.yaml")
    return {**ideal, "layer_overhead_s": hf["layer_overhead_s"],
            "expert_overhead_s": hf["expert_overhead_s"],
            # the stock profiles charge a draft layer as one MLP call and no offload host cost
            "draft_overhead_s": hf["expert_overhead_s"], "offload_layer_overhead_s": 0.0}


def current_profile(ctx: Ctx) -> tuple[dict, dict]:
    """The best values so far (measured where a stage succeeded, else h200's) and their sources."""
    fb = _fallbacks()
    vals = {k: float(fb[k]) for k in NUMERIC_KEYS}
    src = {k: "h200 stock value (not measured)" for k in NUMERIC_KEYS}
    src["host_matrix_flops"] = src["host_mem_bandwidth_Bps"] = "copied from h200_ideal.yaml"

    def take(key, stage, field, what):
        v = ctx.stage(stage).get(field)
        if isinstance(v, (int, float)) and v > 0 and math.isfinite(v):
            vals[key], src[key] = float(v), f"measured: {what}"

    take("launch_overhead_s", "launch", "launch_per_kernel_s", "tiny kernels, sync at end")
    take("h2d_bandwidth_Bps", "h2d", "fit_bandwidth_Bps", "pinned H2D fit")
    take("h2d_latency_s", "h2d", "fit_latency_s", "pinned H2D fit")
    take("mem_bandwidth_Bps", "hbm", "copy_bandwidth_Bps", "device-to-device copy (read+write)")
    take("matrix_flops", "hbm", "gemm_flops", "large GEMM")
    fit = ctx.stage("roles").get("fit", {})
    for key in ("layer_overhead_s", "expert_overhead_s"):
        v = fit.get(key)
        if isinstance(v, (int, float)) and v >= 0 and math.isfinite(v):
            vals[key] = float(v)
            src[key] = f"fit: eager {fit.get('model')} layer at T=1 (scripts/calibrate_gpu.py fit_overheads)"
    v = fit.get("draft_overhead_s")
    if isinstance(v, (int, float)) and v >= 0 and math.isfinite(v):
        vals["draft_overhead_s"] = float(v)
        src["draft_overhead_s"] = (f"fit: fused INT4 draft layer of {fit.get('model')} at T=1 "
                                   "minus its roofline (time_draft_layer)")
    off = ctx.stage("table").get("offload_fit", {})
    v = off.get("offload_layer_overhead_s")
    if isinstance(v, (int, float)) and v >= 0 and math.isfinite(v):
        vals["offload_layer_overhead_s"] = float(v)
        src["offload_layer_overhead_s"] = (f"fit: real {off.get('real_label')} lru - resident "
                                           "TPOT beyond the virtual clock's, per MoE layer (stage_table)")
    return vals, src


# ======================================================================================
# 1. launch overhead
# ======================================================================================
def stage_launch(ctx: Ctx) -> dict:
    n = 300 if ctx.quick else 3000
    x = torch.zeros(1, device=ctx.device)
    out: dict = {"kernels": n}
    best_total, best_host = math.inf, math.inf
    for _ in range(3):
        for _ in range(50):
            x.add_(1)
        ctx.clock.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        host = time.perf_counter() - t0  # Python + dispatch + launch, before the GPU drains
        ctx.clock.sync()
        best_total, best_host = min(best_total, time.perf_counter() - t0), min(best_host, host)
    out["launch_per_kernel_s"] = best_total / n
    out["dispatch_per_op_s"] = best_host / n
    a, w = torch.randn(1, 16, device=ctx.device), torch.randn(16, 16, device=ctx.device)
    out["linear_per_op_s"] = ctx.clock.pipelined(lambda: F.linear(a, w), iters=n // 3)
    if ctx.cuda:  # the device-side cost per kernel, with the host out of the way
        try:
            graph, per = torch.cuda.CUDAGraph(), 200
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    x.add_(1)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for _ in range(per):
                    x.add_(1)
            out["graph_per_kernel_s"] = ctx.clock.pipelined(graph.replay, iters=20) / per
        except Exception as e:  # noqa: BLE001
            out["graph_error"] = repr(e)
    return out


# ======================================================================================
# 2. pinned H2D
# ======================================================================================
def stage_h2d(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return {"skipped": "needs CUDA (pinned host memory, copy stream, events)"}
    sizes = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, DEEPSEEK_EXPERT_BYTES, 64 * MiB, 256 * MiB]
    if ctx.quick:
        sizes = sizes[:6]
    stream = torch.cuda.Stream()
    points = []
    for size in sizes:
        src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(size, dtype=torch.uint8, device=ctx.device)
        reps = max(5, min(40, (512 * MiB) // size))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        with torch.cuda.stream(stream):
            for _ in range(2):
                dst.copy_(src, non_blocking=True)
            for s, e in events:
                s.record(stream)
                dst.copy_(src, non_blocking=True)
                e.record(stream)
        stream.synchronize()
        each = sorted(s.elapsed_time(e) / 1e3 for s, e in events)
        span = events[0][0].elapsed_time(events[-1][1]) / 1e3
        points.append({"bytes": size, "median_s": each[len(each) // 2], "min_s": each[0],
                       "reps": reps, "back_to_back_Bps": size * reps / span})
        del src, dst
    out: dict = {"points": points}
    lat, bw = fit_latency_bandwidth([p["bytes"] for p in points], [p["median_s"] for p in points])
    out["fit_latency_s"], out["fit_bandwidth_Bps"] = lat, bw
    out["fit_max_rel_error"] = max(abs(lat + p["bytes"] / bw - p["median_s"]) / p["median_s"]
                                   for p in points)
    expert = next(p for p in points if p["bytes"] == DEEPSEEK_EXPERT_BYTES)
    out["expert_copy_s"] = expert["median_s"]
    try:  # for reference: the same expert from pageable memory (no overlap, staged copy)
        src = torch.empty(DEEPSEEK_EXPERT_BYTES, dtype=torch.uint8)
        dst = torch.empty_like(src, device=ctx.device)
        out["pageable_expert_copy_s"] = ctx.clock.synced(lambda: dst.copy_(src), iters=5)
    except Exception as e:  # noqa: BLE001
        out["pageable_error"] = repr(e)
    return out


# ======================================================================================
# 3. device memory bandwidth and matrix rate
# ======================================================================================
def stage_hbm(ctx: Ctx) -> dict:
    dev, dt = ctx.device, ctx.dtype
    copy_bytes = (256 if ctx.cuda else 32) * MiB if ctx.quick else 1024 * MiB
    elem = torch.empty(0, dtype=dt).element_size()
    a = torch.empty(copy_bytes // elem, dtype=dt, device=dev)
    b = torch.empty_like(a)
    a.fill_(1)
    t = ctx.clock.pipelined(lambda: b.copy_(a), iters=5 if ctx.quick else 20)
    out: dict = {"copy_bytes": copy_bytes, "copy_s": t, "copy_bandwidth_Bps": 2 * copy_bytes / t}
    del a, b
    n = (256 if ctx.quick else 1024) if not ctx.cuda else (4096 if ctx.quick else 8192)
    x, y = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    t = ctx.clock.pipelined(lambda: x @ y, iters=3 if not ctx.cuda else 20)
    out.update(gemm_n=n, gemm_s=t, gemm_flops=2.0 * n ** 3 / t)
    del x, y
    rows, cols = (1024, 1024) if (ctx.quick or not ctx.cuda) else (16384, 8192)
    w, v = torch.randn(rows, cols, device=dev, dtype=dt), torch.randn(1, cols, device=dev, dtype=dt)
    t = ctx.clock.pipelined(lambda: F.linear(v, w), iters=10 if not ctx.cuda else 50)
    out.update(gemv_shape=[rows, cols], gemv_s=t, gemv_weight_Bps=rows * cols * elem / t)
    out["dtype"] = str(dt)
    return out


# ======================================================================================
# 4. per-role and whole-layer step times at the real models' shapes
# ======================================================================================
def shrink(real: dict) -> dict:
    """A CPU-sized copy of a real config (--quick): same architecture, tiny widths."""
    d = dict(real, vocab_size=4096, hidden_size=128, intermediate_size=256)
    heads, kv = real["num_attention_heads"], real.get("num_key_value_heads", real["num_attention_heads"])
    d.update(num_attention_heads=4, num_key_value_heads=4 if kv == heads else 2)
    for key, v in (("moe_intermediate_size", 64), ("shared_expert_intermediate_size", 256),
                   ("kv_lora_rank", 64), ("qk_nope_head_dim", 32), ("qk_rope_head_dim", 16),
                   ("v_head_dim", 32)):
        if key in real:
            d[key] = v
    if real.get("model_type") == "phimoe":
        d["intermediate_size"] = 64  # Phi's experts use intermediate_size
    return d


def all_moe(real: dict, layers: int) -> dict:
    """The real config with `layers` decoder layers, every one of them MoE."""
    d = dict(real, num_hidden_layers=layers)
    if "first_k_dense_replace" in d:
        d["first_k_dense_replace"] = 0
    if d.get("model_type") == "qwen2_moe":
        d.update(decoder_sparse_step=1, mlp_only_layers=[])
    return d


def _init_random(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif not torch.isfinite(p).all():
                p.fill_(1.0)


def _linears(module: nn.Module) -> list[tuple[int, int]]:
    return [(m.out_features, m.in_features) for m in module.modules() if isinstance(m, nn.Linear)]


def role_shapes(real: dict, elem_bytes: int) -> dict:
    """Weight shapes by role and the cost model's charged sizes, from the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specter.models.introspect import experts_modules
    from specter.clock.costmodel import charged_sizes

    cfg = AutoConfig.for_model(**real)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    sizes = charged_sizes(meta, f"real:{real.get('_name_or_path', cfg.model_type)}", elem_bytes)
    idx, experts = experts_modules(meta)[0]
    layer = meta.model.layers[idx]
    shared, router = [], []
    for name, child in layer.mlp.named_children():
        if child is experts:
            continue
        if name.startswith("shared_expert"):
            shared += _linears(child) or [tuple(p.shape) for p in child.parameters() if p.dim() == 2]
        else:
            router += [tuple(p.shape) for p in child.parameters() if p.dim() == 2]
    return {"config": cfg, "sizes": sizes, "attn": _linears(layer.self_attn), "router": router,
            "shared": shared, "gate_up": tuple(experts.gate_up_proj.shape[1:]),
            "down": tuple(experts.down_proj.shape[1:]), "lm_head": tuple(meta.lm_head.weight.shape),
            "top_k": int(cfg.num_experts_per_tok), "experts_cls": type(experts)}


def time_roles(ctx: Ctx, shapes: dict, T: int, cost) -> dict:
    """Each role's weights as random tensors on the device, timed at T tokens (sync at end)."""
    dev, dt = ctx.device, ctx.dtype
    iters = 5 if ctx.quick else 30
    mk = lambda s: torch.randn(*s, device=dev, dtype=dt) * 0.02  # noqa: E731
    out = {}

    def chain(weights):
        xs = [torch.randn(T, w.shape[1], device=dev, dtype=dt) for w in weights]
        return lambda: [F.linear(x, w) for x, w in zip(xs, weights)]

    s = cost.sizes
    # one routed expert: gate_up [2I, H], act, down [H, I]
    gu, dn = mk(shapes["gate_up"]), mk(shapes["down"])
    h = torch.randn(T, gu.shape[1], device=dev, dtype=dt)

    def expert():
        g, u = F.linear(h, gu).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, dn)

    roles = {"expert": (expert, cost.matmul_s(T, s.expert_params, kernels=3)),
             "attn_projections": (chain([mk(w) for w in shapes["attn"]]),
                                  cost.matmul_s(T, s.attn_params, kernels=6)),
             "router": (chain([mk(w) for w in shapes["router"]]),
                        cost.matmul_s(T, s.router_params, kernels=2)),
             "lm_head": (chain([mk(shapes["lm_head"])]), cost.matmul_s(T, s.lm_head_params))}
    if shapes["shared"]:
        sw = [mk(w) for w in shapes["shared"]]
        x = torch.randn(T, sw[0].shape[1], device=dev, dtype=dt)

        def shared():  # gate, up, down (Linear order in HF's MLP: gate_proj, up_proj, down_proj)
            g, u = F.linear(x, sw[0]), F.linear(x, sw[1])
            return F.linear(F.silu(g) * u, sw[2])

        roles["shared"] = (shared, cost.matmul_s(T, s.shared_params, kernels=3))
    for name, (fn, model_s) in roles.items():
        t = ctx.clock.pipelined(fn, iters=iters)
        out[name] = {"measured_s": t, "roofline_s": model_s, "roofline_over_measured": model_s / t}
    return out


def time_experts_loop(ctx: Ctx, shapes: dict) -> dict:
    """The HF eager experts loop at T=1 with 1 and with top-k experts forced: its slope is the
    eager cost of one more MLP call."""
    dev, dt = ctx.device, ctx.dtype
    cfg = shapes["config"]
    with torch.device(dev):
        mod = shapes["experts_cls"](cfg).to(dt)
    _init_random(mod)
    eager = type(mod).forward.__wrapped__  # HF's own loop under use_experts_implementation
    k, H = shapes["top_k"], shapes["gate_up"][1]
    h = torch.randn(1, H, device=dev, dtype=dt)
    res = {}
    for n in (1, k):
        idx = torch.arange(n, device=dev).view(1, n)  # [T=1, n] distinct experts
        w = torch.full((1, n), 1.0 / n, device=dev, dtype=dt)
        with torch.no_grad():
            res[n] = ctx.clock.synced(lambda: eager(mod, h, idx, w), iters=5 if ctx.quick else 30)
    del mod
    return {"one_expert_s": res[1], "top_k_experts_s": res[k], "top_k": k,
            "per_expert_call_s": (res[k] - res[1]) / max(1, k - 1)}


def time_draft_layer(ctx: Ctx, shapes: dict, K: int, cost) -> dict:
    """The draft's fused INT4 routed experts of one MoE layer, as the draft runs them on this
    device (quant backend auto: Triton on CUDA), at T=1 and T=K+1 with the real shapes and
    random weights (2 x top-k distinct experts), host-synchronized around each call (the
    backend reads the routing on the host). Fits `draft_overhead_s`: the T=1 time minus the
    cost model's draft roofline (`cost` has no framework overheads)."""
    from specter.quant.build import resolve_backend
    from specter.quant.formats import rtn_quantize
    from specter.quant.kernels import make_experts

    dev, dt, k = ctx.device, ctx.dtype, shapes["top_k"]
    (two_i, H), (_, inter) = shapes["gate_up"], shapes["down"]
    n_exp, group = 2 * k, 128
    backend, _ = resolve_backend("auto", 4, dev, {group})
    gen = torch.Generator(device="cpu").manual_seed(0)
    quant = lambda o, i: rtn_quantize(torch.randn(o, i, generator=gen) * 0.02, 4, group).to(dev)  # noqa: E731
    gate_up = [quant(two_i, H) for _ in range(n_exp)]
    down = [quant(H, inter) for _ in range(n_exp)]
    for qm in gate_up + down:
        qm.scales = qm.scales.to(dt)

    def act(x):
        g, u = x.chunk(2, dim=-1)
        return F.silu(g) * u

    experts = make_experts(backend, gate_up, down, act, dt)
    out: dict = {"backend": backend, "experts": n_exp, "group": group}
    for T in (1, K + 1):
        h = torch.randn(T, H, device=dev, dtype=dt)
        idx = torch.stack([torch.randperm(n_exp, generator=gen)[:k] for _ in range(T)]).to(dev)
        w = torch.full((T, k), 1.0 / k, device=dev, dtype=dt)
        with torch.no_grad():
            t = ctx.clock.synced(lambda: experts(h, idx, w), iters=5 if ctx.quick else 30)
        per_expert = torch.unique(idx, return_counts=True)[1].tolist()
        roof = cost.draft_experts_s(per_expert, 4, group) / cost.sizes.moe_multiplier
        out[f"T{T}"] = {"measured_s": t, "roofline_s": roof, "tokens_per_expert": per_expert}
    out["fit"] = clamped("draft_overhead_s", out["T1"]["measured_s"] - out["T1"]["roofline_s"])
    return out


def time_layers(ctx: Ctx, real: dict, impl: str, K: int, ctx_tokens: int = 32) -> dict:
    """Eager decode steps of 1- and 3-layer all-MoE models of the real architecture (random
    weights, DynamicCache of `ctx_tokens`): per-layer seconds at T=1 and T=K+1, and the routed
    experts one layer hit at T=K+1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specter.decoding.batch import forward_logits, new_cache
    from specter.models.introspect import experts_modules

    out: dict = {"impl": impl, "context": ctx_tokens}
    steps: dict[int, dict[int, float]] = {}
    hit: dict[int, list[int]] = {}
    for layers in (1, 3):
        cfg = AutoConfig.for_model(**all_moe(real, layers))
        with torch.device(ctx.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=ctx.dtype)
        _init_random(model)
        model.eval()
        if impl != "default":
            model.set_experts_implementation(impl)
        out.setdefault("experts_implementation", {})[layers] = model.config._experts_implementation
        seen: list = []  # the last top_k_index [T, k] of the first MoE layer (no sync here)
        hook = experts_modules(model)[0][1].register_forward_pre_hook(
            lambda m, a: seen.__setitem__(slice(None), [a[1]]))
        cache = new_cache(model)
        vocab = cfg.vocab_size
        with torch.no_grad():
            forward_logits(model, torch.randint(0, vocab, (1, ctx_tokens), device=ctx.device), cache)
        steps[layers] = {}
        for T in (1, K + 1):
            ids = torch.randint(0, vocab, (1, T), device=ctx.device)
            crop = lambda: cache.crop(-(cache.get_seq_length() - ctx_tokens))  # noqa: E731
            with torch.no_grad():
                steps[layers][T] = ctx.clock.synced(lambda: forward_logits(model, ids, cache),
                                                    iters=5 if ctx.quick else 30, between=crop)
            # host sync, outside timing: tokens per routed expert the layer computed
            hit[T] = torch.unique(seen[0], return_counts=True)[1].tolist() if seen else []
        hook.remove()
        del model, cache
        if ctx.cuda:
            torch.cuda.empty_cache()
    for T in (1, K + 1):
        out[f"step_1layer_T{T}_s"] = steps[1][T]
        out[f"step_3layer_T{T}_s"] = steps[3][T]
        out[f"layer_T{T}_s"] = (steps[3][T] - steps[1][T]) / 2
        out[f"forward_rest_T{T}_s"] = steps[1][T] - out[f"layer_T{T}_s"]  # embedding, lm head, glue
        out[f"tokens_per_expert_T{T}"] = hit[T]
    return out


def stage_roles(ctx: Ctx) -> dict:
    from specter.models.real_configs import REAL_CONFIGS
    from specter.clock.costmodel import CostModel

    K = ctx.args.k
    models = [m for m in ctx.args.models.split(",") if m]
    deadline = ctx.t0 + ctx.args.roles_frac * ctx.budget
    elem = torch.empty(0, dtype=ctx.dtype).element_size()
    out: dict = {"K": K, "models": {}}
    ctx.results["stages"]["roles"] = out  # partial results survive a stop
    fit_model = ctx.args.fit_model if ctx.args.fit_model in models else models[0]
    for name in models:
        if time.monotonic() > deadline:
            out["models"][name] = {"skipped": "time budget of the roles stage spent"}
            continue
        res: dict = {}
        out["models"][name] = res
        try:
            real = shrink(REAL_CONFIGS[name]) if ctx.quick else REAL_CONFIGS[name]
            shapes = role_shapes(real, elem)
            vals, _ = current_profile(ctx)
            roof = CostModel(hardware_profile(vals, "roofline", overheads=False), shapes["sizes"])
            res["sizes"] = {k: v for k, v in shapes["sizes"].as_record().items()}
            for T in (1, K + 1):
                res[f"roles_T{T}"] = time_roles(ctx, shapes, T, roof)
            res["experts_loop"] = time_experts_loop(ctx, shapes)
            res["layers_eager"] = time_layers(ctx, real, "eager", K)
            # 1. Fit on the eager layer (per-expert loop, as the offload runtime runs experts).
            loop, lay = res["experts_loop"], res["layers_eager"]
            hit1 = lay["tokens_per_expert_T1"] or [1] * shapes["top_k"]
            rest = predicted_layer_s(roof, 1, lay["context"] + 1, hit1)
            fit = fit_overheads(layer_s=lay["layer_T1_s"], expert_call_s=loop["per_expert_call_s"],
                                expert_roofline_s=roof.matmul_s(1, shapes["sizes"].expert_params, kernels=3),
                                layer_rest_s=rest, n_mlp_calls=len(hit1) + (1 if shapes["shared"] else 0))
            res["fit"] = fit
            try:  # the draft's fused INT4 layer: its own framework cost (not an MLP call's)
                res["draft_layer"] = time_draft_layer(ctx, shapes, K, roof)
                fit.update(res["draft_layer"]["fit"])
            except Exception as e:  # noqa: BLE001
                res["draft_layer"] = {"error": repr(e)}
            # 2. Check (not fitted): the layer at T=K+1 under the fitted profile.
            fitted = CostModel(hardware_profile({**vals, **fit}, "fitted"), shapes["sizes"])
            hitk = lay[f"tokens_per_expert_T{K + 1}"]
            pred = predicted_layer_s(fitted, K + 1, lay["context"] + K + 1, hitk)
            res["check_layer_TK1"] = {"measured_s": lay[f"layer_T{K + 1}_s"], "predicted_s": pred,
                                      "predicted_over_measured": pred / lay[f"layer_T{K + 1}_s"]
                                      if lay[f"layer_T{K + 1}_s"] > 0 else math.nan}
            # 3. The default experts implementation (grouped_mm where available: what resident
            # runs use) for comparison; not used by the fit.
            if time.monotonic() < deadline:
                try:
                    res["layers_default"] = time_layers(ctx, real, "default", K)
                except Exception as e:  # noqa: BLE001
                    res["layers_default"] = {"error": repr(e)}
        except Exception as e:  # noqa: BLE001
            res["error"] = repr(e)
            res["traceback"] = traceback.format_exc()
        for m in [fit_model] + models:  # the asked model's fit, else the first that has one
            f = out["models"].get(m, {}).get("fit")
            if f:
                out["fit"] = dict(f, model=m)
                break
        ctx.save()
    return out


# ======================================================================================
# 5. the profile
# ======================================================================================
def stage_profile(ctx: Ctx) -> dict:
    vals, src = current_profile(ctx)
    values = {"name": ctx.args.name, "device": "auto", "clock": "virtual", "charge": "auto",
              "engine": "hf", **vals}
    src.update(name="", device="", clock="", charge="the real model's sizes by default; the "
               "error table runs charge=own", engine="an eager framework (HF / PyTorch eager)")
    path = ctx.out / "hardware_measured.yaml"
    path.write_text(profile_yaml(values, src))
    return {"path": str(path), "values": values, "sources": src}


# ======================================================================================
# 6. the error table
# ======================================================================================
def _built(name: str) -> bool:
    from specter.models.zoo import checkpoint_dir

    return (checkpoint_dir(name) / "specter_build.json").exists()


def start_build(ctx: Ctx, name: str) -> None:
    """Build the table's project-made model in the background (CPU training) while the device
    stages run; leaves cores free for the timing process."""
    if _built(name):
        return
    threads = max(1, (os.cpu_count() or 2) // 2)  # the other half for the timing process
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    log = open(ctx.out / f"build_{name}.log", "w")
    code = (f"import torch; torch.set_num_threads({threads}); from specter.models.zoo import "
            f"ensure_project_model; print(ensure_project_model({name!r}, progress=False))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    ctx.build = (proc, name, log)
    ctx.results["meta"]["background_build"] = {"model": name, "threads": threads,
                                               "started_at_s": round(ctx.elapsed(), 1)}


def wait_build(ctx: Ctx, reserve_s: float) -> str | None:
    """Wait for the background build while at least `reserve_s` of budget would remain;
    returns an error note, or None when the model is built."""
    if ctx.build is None:
        return None
    proc, name, log = ctx.build
    while proc.poll() is None and ctx.remaining() > reserve_s:
        time.sleep(1.0)
    info = ctx.results["meta"]["background_build"]
    if proc.poll() is None:
        proc.kill()  # our own child, by its pid
        proc.wait()
        info["killed_at_s"] = round(ctx.elapsed(), 1)
        note = f"background build of {name} not done with {reserve_s:.0f} s of budget left"
    else:
        info["finished_at_s"] = round(ctx.elapsed(), 1)
        info["returncode"] = proc.returncode
        note = None if _built(name) else f"background build of {name} failed (rc {proc.returncode})"
    log.close()
    ctx.build = None
    return note


def run_cases(ctx: Ctx, label: str, overrides: list[str], systems: list[str], model: str,
              later: int = 0) -> dict:
    """One `run.py -m` sweep over `systems`; records under OUT/records_<label>."""
    from experiments import records

    out_dir = ctx.out / f"records_{label}"
    w = ctx.args
    cmd = [sys.executable, str(REPO / "run.py"), "-m", f"model={model}",
           "system=" + ",".join(systems), "dataset=gsm8k", f"workload.items={w.items}",
           f"workload.max_new_tokens={w.max_new_tokens}", f"workload.repeats={w.repeats}",
           "progress=false",
           f"out_dir={out_dir}", *overrides]
    # leave each later case of the table ~25 s (one process, at least its first system)
    timeout = max(5.0, ctx.remaining() - 10.0 - 25.0 * later)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if ctx.args.threads:
        env["OMP_NUM_THREADS"] = str(ctx.args.threads)
    t0 = time.monotonic()
    info: dict = {"cmd": " ".join(cmd), "timeout_s": round(timeout, 1)}
    log = ctx.out / "logs" / f"table_{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        log.write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
        info["returncode"] = p.returncode
        if p.returncode != 0:
            info["stderr_tail"] = p.stderr[-1500:]
    except subprocess.TimeoutExpired as e:
        log.write_text(str(e.stdout or "") + "\n--- stderr ---\n" + str(e.stderr or ""))
        info["timeout"] = True
    info["wall_s"] = round(time.monotonic() - t0, 1)
    info["summary"] = summarize_records(records.load(out_dir))  # rows written before any stop
    return info


def measured_overrides(vals: dict, name: str) -> list[str]:
    """The measured profile as overrides of h200_hf (conf/ cannot list a file under --out)."""
    return ["hardware=h200_hf", f"hardware.name={name}"] + [
        f"hardware.{k}={float(vals[k])!r}" for k in NUMERIC_KEYS]


def stage_table(ctx: Ctx) -> dict:
    from experiments import records

    a = ctx.args
    systems = [s for s in a.systems.split(",") if s]
    model = a.table_model
    out: dict = {"systems": systems, "cases": {}, "notes": []}
    need = 60.0 if ctx.quick else 150.0  # rough time the runs below need
    note = wait_build(ctx, reserve_s=need)
    if note or not _built(model) and ctx.remaining() < need + 60:
        out["notes"].append((note or f"{model} not built") + f"; falling back to {a.fallback_model}")
        model = a.fallback_model
    out["model"] = model
    # 1. Real time: CUDA (lru/specter use the real CUDA link); on a CPU only resident has a real
    # clock. --real-records: a GPU run's real records instead (re-deriving its table anywhere).
    if a.real_records:
        real_label, real_systems, real_over = "cuda", [], []
        out["cases"]["cuda"] = {"from": a.real_records,
                                "summary": summarize_records(records.load(Path(a.real_records)))}
    elif ctx.cuda:
        real_label, real_systems, real_over = "cuda", systems, ["hardware=cuda"]
    else:
        real_systems = [s for s in systems if s == "resident"]
        # eager, as the profiles it is compared with model (auto compiles on the CPU's clock)
        real_label, real_over = "cpu", ["hardware=cpu", "system.compile=off"]
        out["notes"].append("CPU: offloading systems have no real-time link here; their "
                            "measured column is empty")
    path = ctx.out / "hardware_measured.yaml"
    given = Path(a.profile) if a.profile else path
    vals = profile_numbers(load_profile_yaml(given)) if given.exists() else current_profile(ctx)[0]
    vals["offload_layer_overhead_s"] = 0.0  # the "measured" case: none; fit below
    plan = [(real_label, real_over, real_systems),
            ("measured", measured_overrides(vals, a.name) + ["hardware.charge=own"], systems),
            ("measured_fit", None, systems),  # overrides once the fit exists
            ("h200_hf", ["hardware=h200_hf", "hardware.charge=own"], systems),
            ("h200_ideal", ["hardware=h200_ideal", "hardware.charge=own"], systems)]
    out["real_label"] = real_label
    ctx.results["stages"]["table"] = out
    try:
        for i, (label, overrides, syss) in enumerate(plan):
            if ctx.remaining() < 15:
                out["cases"][label] = {"skipped": "time budget spent"}
                continue
            if overrides is None:
                fit = fit_offload(ctx, out, model)
                if fit is None:
                    out["cases"][label] = {"skipped": "no offload fit (needs real and virtual "
                                                      "lru and resident)"}
                    continue
                vals = dict(vals, offload_layer_overhead_s=fit["offload_layer_overhead_s"])
                write_fitted_profile(ctx, vals, given if given.exists() else None)
                overrides = measured_overrides(vals, a.name) + ["hardware.charge=own"]
            if syss:
                out["cases"][label] = run_cases(ctx, label, overrides, syss, model,
                                                later=len(plan) - 1 - i)
            ctx.results["stages"]["table"] = out
            table_rows(ctx, out)  # written after every case: a stop later keeps these rows
            ctx.save()
    finally:
        table_rows(ctx, out)
    return out


def moe_layer_count(model: str) -> int:
    """MoE layers of a project-made model (its checkpoint's config, on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specter.models.introspect import experts_modules
    from specter.models.zoo import checkpoint_dir

    cfg = AutoConfig.from_pretrained(checkpoint_dir(model))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    return len(experts_modules(meta))


def fit_offload(ctx: Ctx, out: dict, model: str) -> dict | None:
    from experiments import records

    def summary(label):
        done = out["cases"].get(label, {}).get("summary")
        folder = ctx.out / f"records_{label}"
        return done if done is not None else (
            summarize_records(records.load(folder)) if folder.exists() else {})

    fit = fit_offload_layer(summary(out["real_label"]), summary("measured"), moe_layer_count(model))
    if fit is not None:
        out["offload_fit"] = dict(fit, real_label=out["real_label"])
    return fit


def table_rows(ctx: Ctx, out: dict) -> None:
    """The table from the cases run so far: every virtual profile against the real clock."""
    from experiments import records

    a, systems, real_label, model = ctx.args, out["systems"], out["real_label"], out["model"]

    def summary(label: str) -> dict:  # a case cut short still has the rows it wrote
        done = out["cases"].get(label, {}).get("summary")
        folder = ctx.out / f"records_{label}"
        if done is not None:
            return done
        return summarize_records(records.load(folder)) if folder.exists() else {}

    measured = summary(real_label)
    virtual = {p: summary(p) for p in TABLE_PROFILES}
    notes = {}
    for p in TABLE_PROFILES:
        for s in systems:
            why = []
            if s not in measured:
                why.append("no real-time run on CPU" if not ctx.cuda and s != "resident"
                           else "no measured records")
            if s not in virtual[p]:
                why.append("no virtual records")
            notes[(s, p)] = "; ".join(why)
    rows = error_rows(measured, virtual, systems, notes)
    warm = f", repeat 0 of {a.repeats} dropped as warm-up" if a.repeats > 1 else ""
    write_table(ctx, rows, f"virtual clock vs real {real_label} time: model={model}, "
                f"{a.items} items x {a.max_new_tokens} new tokens{warm}, charge=own")
    out["rows"] = rows


def write_table(ctx: Ctx, rows: list[dict], title: str) -> None:
    import csv

    (ctx.out / "error_table.md").write_text(rows_markdown(rows, title))
    with open(ctx.out / "error_table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["system"])
        w.writeheader()
        w.writerows(rows)


# ======================================================================================
# driver
# ======================================================================================
STAGES = {"launch": stage_launch, "h2d": stage_h2d, "hbm": stage_hbm, "roles": stage_roles,
          "profile": stage_profile, "table": stage_table}
MIN_S = {"launch": 3, "h2d": 5, "hbm": 5, "roles": 20, "profile": 0, "table": 30}


def summary_lines(ctx: Ctx) -> list[str]:
    st = ctx.results["stages"]
    lines = [f"calibrate_gpu: device={ctx.device} dtype={ctx.dtype} quick={ctx.quick} "
             f"elapsed={ctx.elapsed():.0f}s of {ctx.budget:.0f}s -> {ctx.out}"]
    for name in STAGES:
        s = st.get(name)
        state = ("not run" if s is None else "ERROR " + s["error"] if "error" in s
                 else "skipped: " + s["skipped"] if "skipped" in s else f"ok ({s.get('wall_s', 0):.0f}s)")
        lines.append(f"  {name:8s} {state}")
    for model, r in st.get("roles", {}).get("models", {}).items():
        if "error" in r or "skipped" in r:
            lines.append(f"  roles/{model}: " + (f"ERROR {r['error']}" if "error" in r
                                                  else f"skipped: {r['skipped']}"))
    prof = (st.get("profile") or st.get("profile_fallback") or {}).get("values")
    if prof:
        lines.append("  profile: " + ", ".join(f"{k}={prof[k]:.3g}" for k in NUMERIC_KEYS[:7]))
    fit = st.get("roles", {}).get("fit")
    if fit:
        chk = st["roles"]["models"][fit["model"]].get("check_layer_TK1", {})
        lines.append(f"  fit ({fit['model']}): layer_overhead={fit['layer_overhead_s'] * 1e6:.0f}us "
                     f"expert_overhead={fit['expert_overhead_s'] * 1e6:.0f}us; layer at T=K+1 "
                     f"predicted/measured={chk.get('predicted_over_measured', math.nan):.2f}")
        draft = st["roles"]["models"][fit["model"]].get("draft_layer", {})
        if "fit" in draft:
            lines.append(f"  draft layer ({draft['backend']}): T=1 "
                         f"{draft['T1']['measured_s'] * 1e6:.0f}us measured vs "
                         f"{draft['T1']['roofline_s'] * 1e6:.0f}us roofline -> draft_overhead="
                         f"{draft['fit']['draft_overhead_s'] * 1e6:.0f}us")
    off = st.get("table", {}).get("offload_fit")
    if off:
        lines.append(f"  offload fit: lru - resident {off['gap_ms']:.3f} ms/token beyond the "
                     f"virtual clock over {off['moe_layers']} MoE layers -> offload_layer_overhead="
                     f"{off['offload_layer_overhead_s'] * 1e6:.0f}us")
    for r in st.get("table", {}).get("rows", []):
        lines.append(f"  {r['system']:9s} {r['profile']:10s} real {r['measured_tpot_ms']:8.3f} ms  "
                     f"virtual {r['virtual_tpot_ms']:8.3f} ms  ratio "
                     f"{r['ratio_virtual_over_measured']:.2f}  hidden {r['measured_hidden_frac']:.2f}"
                     f"/{r['virtual_hidden_frac']:.2f}")
    return lines


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp16", "bf16", "fp32"],
                   help="auto: fp16 on CUDA, fp32 on the CPU")
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "results" / "calibrate_gpu"))
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting work after this")
    p.add_argument("--quick", action="store_true", help="tiny shapes and tiny_deepseek (CPU smoke test)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ",".join(STAGES))
    p.add_argument("--name", default="h200_measured", help="the profile's name")
    p.add_argument("--k", type=int, default=16, help="draft depth K: roles are timed at T=1 and T=K+1")
    p.add_argument("--models", default=None, help="real configs for the roles stage "
                   "(default deepseek,qwen,phi; --quick: deepseek)")
    p.add_argument("--fit-model", default="deepseek", help="whose layer fit goes into the profile")
    p.add_argument("--roles-frac", type=float, default=0.4,
                   help="the roles stage starts no new model after this fraction of the budget")
    p.add_argument("--systems", default="resident,lru,specter")
    p.add_argument("--table-model", default=None, help="default small_deepseek; --quick: tiny_deepseek")
    p.add_argument("--fallback-model", default="tiny_deepseek")
    p.add_argument("--real-records", default=None,
                   help="the table's real-time side from a GPU run's records folder (e.g. its "
                        "records_cuda) instead of running it: re-derive that table on any machine")
    p.add_argument("--profile", default=None,
                   help="start from this measured profile yaml (a GPU run's hardware_measured.yaml) "
                        "instead of the stages' measurements, e.g. with --stages table")
    p.add_argument("--items", type=int, default=None, help="workload.items (default 2; --quick 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 32; --quick 16")
    p.add_argument("--repeats", type=int, default=None,
                   help="workload.repeats (default 2, repeat 0 a dropped warm-up; --quick 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads here and in the runs (default: torch's on CUDA, 1 on the CPU)")
    a = p.parse_args(argv)
    a.models = a.models or ("deepseek" if a.quick else "deepseek,qwen,phi")
    a.table_model = a.table_model or ("tiny_deepseek" if a.quick else "small_deepseek")
    a.items = a.items or (1 if a.quick else 2)
    a.max_new_tokens = a.max_new_tokens or (16 if a.quick else 32)
    a.repeats = a.repeats or (1 if a.quick else 2)
    if a.threads is None and a.device == "cpu":
        a.threads = 1
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ctx = Ctx(a)
    ctx.out.mkdir(parents=True, exist_ok=True)
    stages = [s for s in a.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"error: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}",
              file=sys.stderr)
        return 2
    ctx.results["meta"].update(args=vars(a), torch=torch.__version__, cuda=torch.version.cuda,
                               started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA GPU; use --device cpu --quick",
              file=sys.stderr)
        ctx.results["meta"]["error"] = "no CUDA device"
        ctx.save()
        return 2
    if ctx.cuda:
        ctx.results["meta"]["gpu"] = torch.cuda.get_device_name(ctx.device)
    signal.signal(signal.SIGTERM, _on_sigterm)
    for name in STAGES:
        if name not in stages:
            continue
        if name == "hbm" and "table" in stages:  # after launch/h2d (the host-sensitive ones)
            try:
                start_build(ctx, a.table_model)
            except Exception as e:  # noqa: BLE001
                ctx.results["meta"]["background_build_error"] = repr(e)
        t0 = time.monotonic()
        stop = False
        if ctx.remaining() < MIN_S[name]:
            res = {"skipped": f"time budget spent ({ctx.elapsed():.0f}s of {ctx.budget:.0f}s)"}
        else:
            try:
                res = STAGES[name](ctx)
            except Terminated:
                res, stop = {"error": "terminated (SIGTERM) during this stage"}, True
            except Exception as e:  # noqa: BLE001
                res = {"error": repr(e), "traceback": traceback.format_exc()}
        if "error" in res:  # keep what the stage got to (roles, table leave partial results)
            res = {**ctx.results["stages"].get(name, {}), **res}
        res["wall_s"] = round(time.monotonic() - t0, 2)
        ctx.results["stages"][name] = res
        ctx.save()
        if ctx.cuda:
            torch.cuda.empty_cache()
        if stop:
            break
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if "values" not in ctx.stage("profile"):
        try:  # whatever happened, leave a profile behind
            ctx.results["stages"].setdefault("profile_fallback", stage_profile(ctx))
        except Exception as e:  # noqa: BLE001
            ctx.results["meta"]["profile_error"] = repr(e)
    if ctx.build is not None:  # the table never waited for it
        proc = ctx.build[0]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.build[2].close()
    ctx.results["meta"]["elapsed_s"] = round(ctx.elapsed(), 1)
    ctx.save()
    lines = summary_lines(ctx)
    (ctx.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any("error" in s for s in ctx.results["stages"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
