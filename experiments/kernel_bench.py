"""INT4 expert-kernel microbenchmark: one MoE layer's routed experts at the real
models' expert shapes, measured on this machine beside what the cost model charges on the A100.

`python -m experiments.kernel_bench --out results/kernel [--device cpu|cuda|auto]
 [--shapes deepseek,qwen,phi] [--tokens 1,4,17] [--repeats N] [--warmup N] [--quick]
 [--write-choice]`

For each shape (hidden x expert intermediate, expert count and top-k of the real model, from
specter.models.real_configs) and each token count T (1: a draft step; K+1 = 17: a verification
block), routing is drawn at random (seeded) over the real expert count with the real top-k, and
one layer's routed experts are timed through:
- the draft's INT4 backends of specter.quant.kernels available on the device: `triton` (the
  fused multi-expert kernel, one launch per projection; CUDA only: on the CPU it exists only
  under Triton's interpreter, recorded as not measured), `cuda_int4` (torch's CUDA INT4 GEMM,
  tinygemm, per expert in bf16; CUDA only), `cpu_int4` (torch's CPU INT4 GEMM per
  expert, in fp32 as the project's fp32 models run it, and in bf16, its fast path), `reference`
  (dequantize each expert, then matmuls);
- the full-precision target's experts: `target_serial` (one GEMV per (token, expert), the
  runtime's `serial` ablation) against `target_grouped` (one GEMM per expert over its tokens:
  SEE's expert-wise verification reordering), as `specter.offload.runtime` computes them.
Before timing, every backend's output is checked: INT4 backends against the dequantize-then-
matmul reference, the target paths against each other and against the reference over the same
weights. A backend that disagrees gets a row with status `mismatch` and no time.

Modelled rows: for the same routing, the seconds `specter.clock.costmodel.CostModel` charges
under hardware=a100_pcie4_ideal (conf/hardware/a100_pcie4_ideal.yaml; sizes of the real model): the draft's
fused kernel (`draft_experts_s`, backend `triton`), the same formula one expert at a time
(`int4_per_expert`, three launches per expert), and the target's experts as the runtime charges
them (`expert_s(1)` per (token, expert) pair when serial, `expert_s(n)` per expert grouped).

Weights are random: INT4 codes and group scales made directly in QuantizedMatrix's layout
(group 128), one expert per distinct routed expert; the target's experts are their dequantized
copies. To keep memory modest the target's full-precision experts are a pool of at most
`--max-weight-gb` (an expert beyond it reuses pool entry `rank % pool`, recorded in
`weight_pool` and `aliased`); with the defaults only phi on the CPU is aliased, and its fp32
expert (315 MB) is far larger than any cache, so reuse does not flatter the time.
Wall time: the check's call and further warm-up calls (`warmup` counts both), then timed calls,
median and 10th/90th percentiles (CUDA: events after a synchronize); `repeats` in a row is the
number of timed calls (under --quick fewer than asked when one call takes over 2 s).
Rows go through experiments.records.CaseStore, one case per (shape, backend, dtype, tokens,
device or modelled hardware, settings); a rerun skips written cases.
Bad input is one sentence on stderr and exit status 2.

This file holds the cases, their records and the CLI; the layer's data and the target's
expert paths are experiments/kernel_layer.py, the timing loop experiments/kernel_timing.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from experiments.kernel_layer import (GROUP, REAL_SHAPES, TINY, ExpertShape,  # noqa: F401 (tests)
                                      _PooledReference, _act, _with, compact, draw_routing,
                                      random_layer, rel_err, shape_of, target_grouped,
                                      target_serial, tolerance)
from experiments.kernel_timing import Settings, _percentile, device_name, measure, once
from experiments.records import CaseStore
from specter.compose import resolve_device
from specter.errors import UserError

EXPERIMENT = "kernel"
HARDWARE = "a100_pcie4_ideal"  # the modelled machine
CONF = Path(__file__).resolve().parents[1] / "conf"
QUICK_CASE_BUDGET_S = 2.0  # --quick: timed calls per case stop at about this many seconds


def modelled_cost(shape: ExpertShape):
    """CostModel of hardware=a100_pcie4_ideal (the yaml's values, through the project's profile
    helper) with the real model's charged sizes (one real MoE layer: multipliers 1)."""
    from omegaconf import OmegaConf

    from specter.config import HardwareConfig
    from specter.clock.timing import profile_of
    from specter.clock.costmodel import ChargedSizes, CostModel, real_charged_sizes

    # OmegaConf reads the yaml as Hydra does (plain YAML 1.1 takes 312.0e12 for a string).
    yaml = OmegaConf.load(CONF / "hardware" / f"{HARDWARE}.yaml")
    hw = HardwareConfig(**OmegaConf.to_container(yaml, resolve=True))
    profile = profile_of(hw)
    if shape.source == "synthetic":
        p = 3 * shape.hidden * shape.inter
        sizes = ChargedSizes(source=f"synthetic:{shape.name}", elem_bytes=2, attn_params=0,
                             router_params=0, shared_params=0, dense_mlp_params=0, expert_params=p,
                             lm_head_params=0, kv_elems_per_token=0, heads=1, head_dim=1)
    else:
        from specter.models.real_configs import REAL_CONFIGS

        sizes = real_charged_sizes(REAL_CONFIGS[shape.name], None, elem_bytes=2)
        assert sizes.expert_params == 3 * shape.hidden * shape.inter, sizes
    return CostModel(profile, sizes)


def draft_variants(s: Settings) -> list[tuple[str, torch.dtype]]:
    """(INT4 backend, activation dtype) pairs for this device; `+graphs`: the same backend
    replayed as a CUDA graph (quant.graphs=on)."""
    if s.device.type == "cuda":
        return [("triton", torch.float16), ("triton+graphs", torch.float16),
                ("cuda_int4", torch.bfloat16), ("gather_int4", torch.bfloat16),
                ("gather_int4+graphs", torch.bfloat16), ("reference", torch.float16)]
    return [("triton", torch.float32), ("cpu_int4", torch.float32), ("cpu_int4", torch.bfloat16),
            ("gather_int4", torch.float32), ("reference", torch.float32)]


ROOFLINE_HARDWARE = "h200_measured"  # the measured H200 profile: HBM bandwidth and GEMM rate


def roofline_ms(shape: ExpertShape, counts: list[int]) -> float:
    """The INT4 draft layer's lower bound on the H200 (conf/hardware/h200_measured.yaml): its
    routed experts' INT4 codes and bf16 group scales read once from HBM, or its GEMM flops at
    the measured rate, whichever is longer (no launch or other overhead)."""
    from omegaconf import OmegaConf

    hw = OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{ROOFLINE_HARDWARE}.yaml"))
    params = 3 * shape.hidden * shape.inter
    weight_bytes = len(counts) * (params // 2 + 2 * params // GROUP)
    flops = 2 * params * sum(counts)
    return 1e3 * max(weight_bytes / float(hw["mem_bandwidth_Bps"]),
                     flops / float(hw["matrix_flops"]))


def write_choice(out: Path, shape: ExpertShape, device: torch.device, log) -> Path | None:
    """Record the fastest INT4 backend measured at `shape` and one token (a draft step) on
    this GPU, where quant.backend=auto reads it (specter.quant.build.kernel_choice_path)."""
    import json

    from experiments import records
    from specter.models.zoo import default_cache_dir
    from specter.quant.build import kernel_choice_path

    df = records.load(out)
    if df.empty:
        return None
    ok = df[(df["experiment"] == EXPERIMENT) & (df["clock"] == "wall") & (df["status"] == "ok")
            & (df["shape"] == shape.name) & (df["tokens"] == 1) & (df["hardware"] == device.type)
            & df["backend"].isin(["triton", "cuda_int4", "cpu_int4", "gather_int4", "reference"])]
    if ok.empty:
        log(f"--write-choice: no INT4 backend timed at {shape.name}, T=1; nothing written")
        return None
    ms = {b: float(g["ms"].min()) for b, g in ok.groupby("backend")}
    path = kernel_choice_path(default_cache_dir(), device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(device)
                                if device.type == "cuda" else device.type,
                                "shape": shape.name, "tokens": 1, "ms": ms,
                                "fastest": min(ms, key=ms.get), "records": str(out),
                                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                               indent=1))
    log(f"--write-choice: fastest INT4 backend at {shape.name}, T=1: {min(ms, key=ms.get)} "
        f"({', '.join(f'{b} {v:.3f} ms' for b, v in sorted(ms.items(), key=lambda x: x[1]))}) "
        f"-> {path}")
    return path


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measured_case(shape: ExpertShape, backend: str, dtype: str, tokens: int, s: Settings) -> dict:
    return {"experiment": EXPERIMENT, "shape": shape.name, "backend": backend, "dtype": dtype,
            "tokens": tokens, "top_k": shape.top_k, "n_experts": shape.n_experts,
            "hidden": shape.hidden, "inter": shape.inter, "group": GROUP, "seed": s.seed,
            "clock": "wall", "hardware": s.hardware, "device": s.device_name,
            "repeats_requested": s.repeats, "warmup": s.warmup, "max_weight_gb": s.max_weight_gb,
            "quick": s.quick}


def modelled_case(shape: ExpertShape, backend: str, tokens: int, seed: int, profile) -> dict:
    return {"experiment": EXPERIMENT, "shape": shape.name, "backend": backend,
            "dtype": "int4" if backend in ("triton", "int4_per_expert") else "float16",
            "tokens": tokens, "top_k": shape.top_k, "n_experts": shape.n_experts,
            "hidden": shape.hidden, "inter": shape.inter, "group": GROUP, "seed": seed,
            "clock": "virtual", "hardware": HARDWARE, "profile": asdict(profile)}


def request_id(case: dict) -> str:
    return f"{case['shape']}-{case['backend']}-{case['dtype']}-t{case['tokens']}"


def _store(out: Path, case: dict) -> CaseStore:
    return CaseStore(out, case)


def _done(out: Path, case: dict) -> bool:
    return _store(out, case).done(request_id(case), 0)


def _write(out: Path, case: dict, **values) -> dict:
    row = {k: v for k, v in case.items() if k != "profile"}
    row.update(request_id=request_id(case), repeat=0, torch=torch.__version__,
               threads=torch.get_num_threads(), **values)
    _store(out, case).write(row)
    return row


def _timed_row(times: list[float], **extra) -> dict:
    return dict(ms=_percentile(times, 0.5), ms_p10=_percentile(times, 0.1),
                ms_p90=_percentile(times, 0.9), repeats=len(times), status="ok", **extra)


def _not_timed(status: str, note: str, **extra) -> dict:
    nan = float("nan")
    return dict(ms=nan, ms_p10=nan, ms_p90=nan, repeats=0, status=status, note=note, **extra)


# ------------------------------------------------------------------------------ the sweeps
MODELLED = ("triton", "int4_per_expert", "target_serial", "target_grouped")


def run_modelled(out: Path, shape: ExpertShape, tokens: list[int], seed: int) -> list[dict]:
    cost = None  # built on first need: the real config on the meta device takes seconds
    rows = []
    for t, backend in [(t, b) for t in tokens for b in MODELLED]:
        if cost is None:
            cost = modelled_cost(shape)
        case = modelled_case(shape, backend, t, seed, cost.hw)
        if _done(out, case):
            continue
        counts = draw_routing(shape, t, seed).counts()
        if backend == "triton":
            s, how = cost.draft_experts_s(counts, 4, GROUP), "draft_experts_s(tokens per expert)"
        elif backend == "int4_per_expert":
            s = sum(cost.draft_experts_s([n], 4, GROUP) for n in counts)
            how = "sum over experts of draft_experts_s([n]) (3 launches per expert)"
        elif backend == "target_serial":
            s, how = sum(n * cost.expert_s(1) for n in counts), "expert_s(1) per (token, expert)"
        else:
            s, how = sum(cost.expert_s(n) for n in counts), "expert_s(n) per expert"
        ms = s * 1e3
        rows.append(_write(out, case, ms=ms, ms_p10=ms, ms_p90=ms, repeats=1, status="modelled",
                           device="A100 40GB PCIe (modelled)", experts_used=len(counts),
                           charged=cost.sizes.source, note=f"CostModel.{how}"))
    return rows


def run_measured(out: Path, shape: ExpertShape, tokens: list[int], s: Settings, log) -> list[dict]:
    from specter.quant import kernels

    variants = draft_variants(s)
    target_dt = s.target_dtype
    cases = {}
    for t in tokens:
        for b, d in variants:
            cases[(b, d, t)] = measured_case(shape, b, _dt(d), t, s)
        for b in ("target_serial", "target_grouped"):
            cases[(b, target_dt, t)] = measured_case(shape, b, _dt(target_dt), t, s)
    pending = {k: c for k, c in cases.items() if not _done(out, c)}
    if not pending:
        return []
    dev = s.device
    t_start = time.perf_counter()
    routings = {t: draw_routing(shape, t, s.seed) for t in tokens}
    experts = sorted(set().union(*(set(r.index.flatten().tolist()) for r in routings.values())))
    gate_up, down = random_layer(shape, len(experts), s.seed)
    idx = {t: compact(r.index, experts).to(dev) for t, r in routings.items()}
    used = {t: int(torch.unique(r.index).numel()) for t, r in routings.items()}
    rows = []

    # The definition: dequantize-then-matmul in fp32 over the same (bf16-exact) numbers.
    ref_experts = kernels.ReferenceExperts([_with(m, torch.float32, dev) for m in gate_up],
                                           [_with(m, torch.float32, dev) for m in down], _act)
    with torch.no_grad():
        ref_out = {t: ref_experts(r.hidden.to(dev), idx[t], r.weights.to(dev))
                   for t, r in routings.items()}
    log(f"{shape.name:8s} {len(experts)} distinct experts; random INT4 layer and its reference "
        f"outputs in {time.perf_counter() - t_start:.1f} s")

    def emit(key, t, values):
        rows.append(_write(out, pending[key], experts_used=used[t], **values))
        r = rows[-1]
        log(f"{shape.name:8s} T={t:<3d} {r['backend']:15s} {r['dtype']:9s} "
            + (f"{r['ms']:9.3f} ms (n={r['repeats']})" if r["status"] == "ok"
               else f"{r['status']}: {r.get('note', '')}"))

    # Draft: INT4 backends.
    for b, d in variants:
        keys = [(b, d, t) for t in tokens if (b, d, t) in pending]
        if not keys:
            continue
        reason = None
        if b.startswith("triton"):
            if dev.type != "cuda":
                reason = ("the fused Triton kernel runs on the CPU only under TRITON_INTERPRET=1, "
                          "a Python interpreter; its time says nothing about the kernel")
            elif not kernels.triton_available():
                reason = "the triton package is not installed (pip install -e .[gpu])"
            elif kernels.interpret_mode():
                reason = "TRITON_INTERPRET=1 is set: the kernel would be interpreted, not compiled"
        elif b == "reference" and s.quick:
            reason = ("--quick does not time the reference (it dequantizes every expert on every "
                      "call); it is still what the other backends are checked against")
        if reason:
            for key in keys:
                emit(key, key[2], _not_timed("not_measured", reason))
            continue
        base, graphs = b.removesuffix("+graphs"), b.endswith("+graphs")
        impl = kernels.make_experts(base, [_with(m, d, dev) for m in gate_up],
                                    [_with(m, d, dev) for m in down], _act, d, graphs=graphs)
        for key in keys:
            t = key[2]
            r = routings[t]
            h, w, i = r.hidden.to(dev, d), r.weights.to(dev, d), idx[t]
            with torch.no_grad():
                got, check_s = once(lambda: impl(h, i, w), dev)
            err = rel_err(got, ref_out[t])
            tol = tolerance(d, dev, fused=base == "triton")
            if not err <= tol:  # NaN included
                emit(key, t, _not_timed("mismatch", f"disagrees with the dequantized reference: "
                                        f"max rel err {err:.3g} > {tol:g}", max_rel_err=err))
                continue
            with torch.no_grad():
                times = measure(lambda: impl(h, i, w), dev, check_s, s)
            extra = {}
            if dev.type == "cuda":  # beside its lower bound on the measured H200
                roof = roofline_ms(shape, r.counts())
                extra = dict(roofline_ms=roof, roofline_hardware=ROOFLINE_HARDWARE,
                             over_roofline=_percentile(times, 0.5) / roof)
            emit(key, t, _timed_row(times, max_rel_err=err, checked_against="reference fp32",
                                    **extra))

    # Target: full-precision experts, serial vs grouped, over a pool of dequantized experts.
    keys = [k for k in pending if k[0].startswith("target_")]
    if keys:
        elem = torch.finfo(target_dt).bits // 8
        per_expert = 3 * shape.hidden * shape.inter * elem
        pool = max(1, min(len(experts), int(s.max_weight_gb * 1e9 // per_expert)))
        aliased = pool < len(experts)
        fp, fp32 = [], []  # the target's pool; its fp32 copy only for an aliased reference
        for e in range(pool):
            g32 = gate_up[e].dequantize(torch.float32).to(dev)
            d32 = down[e].dequantize(torch.float32).to(dev)
            fp.append((g32.to(target_dt), d32.to(target_dt)))  # the same tensors in fp32
            if aliased:
                fp32.append((g32, d32))
        weights_of = lambda e: fp[e % pool]  # noqa: E731
        # The reference's own routing and summation over the very weights the pool holds
        # (aliased experts included), dequantized once instead of on every call.
        pooled_ref = _PooledReference(fp32, [_with(m, torch.float32, dev) for m in gate_up],
                                      [_with(m, torch.float32, dev) for m in down]) \
            if aliased else None
        log(f"{shape.name:8s} target pool: {pool} of {len(experts)} experts "
            f"({pool * per_expert / 1e9:.2f} GB {_dt(target_dt)}), built "
            f"{time.perf_counter() - t_start:.1f} s into the shape")
        paths = {"target_serial": target_serial, "target_grouped": target_grouped}
        for t in tokens:
            todo = [k for k in keys if k[2] == t]
            if not todo:
                continue
            r = routings[t]
            h, w, i = r.hidden.to(dev, target_dt), r.weights.to(dev, target_dt), idx[t]
            with torch.no_grad():
                checks = {b: once(lambda fn=fn: fn(h, i, w, weights_of), dev)
                          for b, fn in paths.items()}
                outs = {b: c[0] for b, c in checks.items()}
                ref = pooled_ref(r.hidden.to(dev), i, r.weights.to(dev)) if aliased else ref_out[t]
            # Each path against the reference over the same weights (fp32: within fp32
            # rounding, the weights being identical); the two paths against each other, and
            # when they disagree the one farther from the reference is refused.
            pair_err = rel_err(outs["target_serial"], outs["target_grouped"])
            is_fp32 = target_dt == torch.float32
            pair_tol, ref_tol = (1e-4, 1e-4) if is_fp32 else (1e-2, tolerance(target_dt, dev))
            errs = {b: rel_err(o, ref) for b, o in outs.items()}
            worst = max(errs, key=errs.get)
            for key in todo:
                b = key[0]
                err = errs[b]
                extra = dict(max_rel_err=err, serial_vs_grouped_rel_err=pair_err,
                             weight_pool=pool, aliased=aliased)
                if err > ref_tol or (pair_err > pair_tol and b == worst) or not math.isfinite(err):
                    emit(key, t, _not_timed("mismatch", f"vs the reference rel err {err:.3g} (tol "
                                            f"{ref_tol:g}); serial vs grouped {pair_err:.3g} (tol "
                                            f"{pair_tol:g})", **extra))
                    continue
                fn = paths[b]
                with torch.no_grad():
                    times = measure(lambda: fn(h, i, w, weights_of), dev, checks[b][1], s)
                emit(key, t, _timed_row(times, checked_against="other target path and reference",
                                        **extra))
        del fp, fp32, pooled_ref
    return rows


# -------------------------------------------------------------------------------------- CLI
def parse_tokens(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UserError("--tokens is empty; give token counts such as 1,4,17.")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UserError(f"--tokens must be comma-separated integers (got '{text}').") from None
    bad = [v for v in values if v < 1]
    if bad:
        raise UserError(f"--tokens must all be at least 1 (got {bad[0]}).")
    return sorted(set(values))


def parse_shapes(text: str) -> list[ExpertShape]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UserError("--shapes is empty; choose from: deepseek, qwen, phi.")
    return [shape_of(n) for n in dict.fromkeys(names)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m experiments.kernel_bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results tree (records/ under it)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--shapes", default=None,
                    help="comma-separated: deepseek,qwen,phi (default all; tests: tiny)")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated token counts (default 1,4,17; --quick 1,17)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed calls (default 10; --quick 3, fewer if they would take over 2 s)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed calls first, the correctness check's call included "
                         "(default 2; --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-weight-gb", type=float, default=None,
                    help="cap on the target's full-precision expert pool "
                         "(default 2 on CPU, 24 on CUDA)")
    ap.add_argument("--write-choice", action="store_true",
                    help="record the fastest INT4 backend at the first shape and T=1 for "
                         "quant.backend=auto on this GPU")
    ap.add_argument("--quick", action="store_true",
                    help="a few minutes on 2 CPU cores: tokens 1,17, 3 repeats, 1 warm-up unless "
                         "given, and the reference backend not timed")
    return ap


def settings_from(args, device: torch.device) -> Settings:
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if repeats < 1 or warmup < 0:
        raise UserError(f"--repeats must be at least 1 and --warmup at least 0 "
                        f"(got {repeats}, {warmup}).")
    cap = args.max_weight_gb
    if cap is None:
        cap = 24.0 if device.type == "cuda" else 2.0
    if not cap > 0:
        raise UserError(f"--max-weight-gb must be positive (got {cap}).")
    return Settings(device=device, device_name=device_name(device), hardware=device.type,
                    seed=args.seed, repeats=repeats, warmup=warmup, max_weight_gb=cap,
                    target_dtype=torch.float16 if device.type == "cuda" else torch.float32,
                    quick=args.quick, case_budget_s=QUICK_CASE_BUDGET_S if args.quick else None)


def summary_table(out: Path) -> str:
    """The rows under `out`, one line per (shape, tokens, backend, dtype, hardware)."""
    import pandas as pd

    from experiments import records

    df = records.load(out)
    if df.empty or "experiment" not in df:
        return "(no rows)"
    df = df[df["experiment"] == EXPERIMENT]
    cols = ["shape", "tokens", "top_k", "backend", "dtype", "hardware", "clock", "ms", "ms_p10",
            "ms_p90", "roofline_ms", "over_roofline", "repeats", "status"]
    df = df[[c for c in cols if c in df]].sort_values(["shape", "tokens", "hardware", "backend",
                                                        "dtype"])
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        return df.to_string(index=False, float_format=lambda v: f"{v:.4g}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shapes = parse_shapes(",".join(REAL_SHAPES) if args.shapes is None else args.shapes)
        tokens = parse_tokens(("1,17" if args.quick else "1,4,17") if args.tokens is None
                              else args.tokens)
        device = resolve_device(args.device, asked_by="--device cuda", instead="--device cpu")
        s = settings_from(args, device)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return UserError.exit_code
    out = Path(args.out)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    log(f"kernel bench: {s.device_name} ({device.type}, {torch.get_num_threads()} threads), "
        f"shapes {','.join(x.name for x in shapes)}, tokens {tokens}, repeats {s.repeats}, "
        f"warm-up {s.warmup}")
    written = 0
    for shape in shapes:
        written += len(run_modelled(out, shape, tokens, s.seed))
        written += len(run_measured(out, shape, tokens, s, log))
    log(f"{written} new rows in {time.perf_counter() - t0:.1f} s under {out}")
    log(summary_table(out))
    if args.write_choice:
        write_choice(out, shapes[0], device, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
