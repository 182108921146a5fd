"""fused_int4 (specter/quant/kernels.py FusedInt4Experts): a layer's routed experts in one fused
INT4 Triton GEMV per projection for every (token, k-slot) pair, inside one custom op
(`specter::int4_moe_pairs`) that torch.compile keeps opaque and a CUDA graph captures.

The Triton kernel runs here through Triton's interpreter (a fresh process: TRITON_INTERPRET
must be set before triton is first imported); the op's CPU body (torch) is what a CPU run
decodes with, compiled by inductor and traced by dynamo into the draft step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from specter.config import ModelConfig
from specter.quant import calibrate, kernels
from test_quant import _act, _random_layer, _routing

CPU = torch.device("cpu")

FUSED_CHECK = """
import torch, sys
sys.path[:0] = [{root!r}, {tests!r}]
from test_quant import _random_layer, _routing, _act
from specter.quant import kernels
from specter.clock.graph_kernels import DEVICE_LAUNCHES
from torch.utils._python_dispatch import TorchDispatchMode

# 1. the kernel against the reference: T = 1 and 2, k = 6, 64 experts, both GATED settings
for T in (1, 2):
    for gated in (True, False):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            gate_up, down = _random_layer(E=64, H=64, I=32, seed=T)
            for qm in gate_up + down:
                qm.scales = qm.scales.to(dtype)
            hidden, idx, w = _routing(T=T, E=64, k=6, H=64, seed=T)
            h, wt = hidden.to(dtype), w.to(dtype)
            ref = kernels.ReferenceExperts(gate_up, down, _act)(h.float(), idx, wt.float())
            fused = kernels.FusedInt4Experts(gate_up, down, _act, dtype, use_triton=True)
            fused.gated = gated  # _act is silu(gate) * up: the kernel's own or in torch
            out = fused(h, idx, wt).float()
            err = float((out - ref).abs().max() / ref.abs().max())
            print("T", T, "gated", gated, dtype, "max relative error", err)
            assert err < tol, (T, gated, dtype, err)

# 2. the op's device path launches DEVICE_LAUNCHES Triton kernels and no other kernel
class Ops(TorchDispatchMode):
    paused = False
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {{}}))

real, launches, seen = kernels._kernel, [], []
class Counted:  # the jitted kernel, its launch counted and run outside the op recorder
    def __init__(self, k): self.k = k
    def __getitem__(self, grid):
        def launch(*a, **kw):
            launches.append(grid)
            mode.paused = True
            try:
                return self.k[grid](*a, **kw)
            finally:
                mode.paused = False
        return launch
kernels._kernel = lambda name="moe_int4_gemm": Counted(real(name))
gate_up, down = _random_layer(E=64, H=64, I=32, seed=0)
fused = kernels.FusedInt4Experts(gate_up, down, _act, torch.float32, use_triton=True)
hidden, idx, w = _routing(T=1, E=64, k=6, H=64, seed=0)
args = (hidden, idx, w, fused.gu_codes, fused.gu_scales, fused.dn_codes, fused.dn_scales,
        fused.gu_group, fused.dn_group, True)
with Ops() as mode:  # the op's body (a mode sees the op itself as one call)
    kernels.int4_moe_pairs._init_fn(*args)
print("launches", len(launches), "aten", seen)
assert len(launches) == DEVICE_LAUNCHES["specter::int4_moe_pairs"] == 2, launches
assert set(seen) <= {{"empty"}}, seen  # allocations only
"""


@pytest.mark.skipif(not kernels.triton_available(), reason="needs the triton package")
def test_fused_kernel_matches_reference_and_launches_two_kernels_under_the_interpreter():
    """fp32 within 1e-5, bf16 within 1e-2 of the dequantize-then-matmul reference (one and two
    tokens, top 6 of 64 experts, silu-gating in the kernel or in torch); the op's device path
    is two Triton launches and no other kernel (what graph_kernels.DEVICE_LAUNCHES says)."""
    root = Path(__file__).parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = FUSED_CHECK.format(root=str(root), tests=str(Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=root, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "launches 2" in res.stdout


@pytest.mark.parametrize("gated", [True, False])
def test_the_cpu_body_matches_the_reference(gated):
    for T in (1, 2):
        gate_up, down = _random_layer(E=64, H=64, I=32, seed=T)
        hidden, idx, w = _routing(T=T, E=64, k=6, H=64, seed=T)
        ref = kernels.ReferenceExperts(gate_up, down, _act)(hidden, idx, w)
        fused = kernels.FusedInt4Experts(gate_up, down, _act, torch.float32)
        assert not fused.use_triton  # the CPU: torch
        fused.gated = gated
        out = fused(hidden, idx, w)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_the_op_compiles_with_inductor_as_one_call_of_two_device_kernels():
    """Under torch.compile(inductor) the op is one opaque fallback (its count: the two
    kernels a GPU launches) and the result equals eager's."""
    from specter.clock.graph_kernels import KernelTally

    gate_up, down = _random_layer(E=64, H=64, I=32, seed=0)
    fused = kernels.FusedInt4Experts(gate_up, down, _act, torch.float32)
    fused.gated = True
    hidden, idx, w = _routing(T=1, E=64, k=6, H=64, seed=0)
    tally = KernelTally()
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, i, ww: fused(h, i, ww) * 2, fullgraph=True,
                             backend=tally.backend("inductor"))
    out = compiled(hidden, idx, w)
    assert torch.allclose(out, fused(hidden, idx, w) * 2, rtol=1e-6, atol=1e-6)
    # the op (2) and one fused kernel: the sum over k slots, the cast and the * 2
    assert tally.graphs == [3], tally.graphs


def test_the_default_gate_is_recognised_on_a_real_model():
    """A tiny DeepSeek's experts use transformers' default gate with SiLU: the kernel gates."""
    from specter.models.introspect import experts_modules
    from specter.placement.loader import load_model

    lm = load_model(ModelConfig(name="tiny_deepseek", source="project", dtype="float32"), CPU,
                    progress=False)
    _, m = experts_modules(lm.model)[0]
    assert kernels.silu_gated(m._apply_gate)
    assert not kernels.silu_gated(_act)


def test_a_compiled_fused_int4_draft_is_lossless():
    """tiny_deepseek's draft step compiled whole on fused_int4 (fullgraph: a graph break would
    raise) decodes what plain `generate` decodes, at several depths."""
    from specter.clock.timing import Timing
    from specter.decoding.batch import DeviceMemory, eos_ids
    from specter.decoding.compiled_draft import StaticKV
    from specter.decoding.draft_mode import DraftMode
    from specter.decoding.draft import speculative_greedy
    from specter.placement.loader import load_model

    lm = load_model(ModelConfig(name="tiny_deepseek", source="project", dtype="float32"), CPU,
                    progress=False)
    qe = calibrate.quantize_experts(lm.model, calibrate.QuantSpec(method="rtn", bits=4, group=32),
                                    None, CPU)
    sw = DraftMode(lm.model, qe, backend="fused_int4")
    assert all(isinstance(d, kernels.FusedInt4Experts) and d.gated for d in sw.draft_layers)
    ids = lm.tokenizer("The committee met on Tuesday to discuss the budget")["input_ids"][:16]
    ref = hf_greedy(lm.model, ids, 20)
    static = StaticKV(sw, compiler="eager")
    for k in (1, 4):
        out = speculative_greedy(lm.model, sw, ids, 20, k, CPU, Timing.wall(CPU).link,
                                 eos_ids(lm.model), DeviceMemory(lm.model, CPU), layout=static)
        assert out.tokens == ref, k
    assert static.steps_run > 0


def test_the_runner_decodes_with_a_compiled_fused_int4_draft_what_resident_decodes(tmp_path):
    """system=specter spec.compile=on quant.backend=fused_int4 through run.py: the same tokens
    as the resident system (plain greedy decoding), the step recorded compiled on fused_int4."""
    import pandas as pd

    from conftest import run_cli

    rows = {}
    for system, extra in (("resident", []), ("specter", ["spec.compile=on",
                                                          "quant.backend=fused_int4",
                                                          "spec.compile_backend=inductor"])):
        out = tmp_path / system
        r = run_cli("model=tiny_deepseek", f"system={system}", "hardware=a100_pcie4_hf",
                    "dataset=gsm8k", "workload.items=1", "workload.repeats=1",
                    "workload.max_new_tokens=16", "progress=false", *extra, f"out_dir={out}")
        assert r.returncode == 0, r.stderr[-2000:]
        rows[system] = pd.read_parquet(next(out.glob("records/*/*.parquet"))).iloc[0]
    assert list(rows["specter"]["output_tokens"]) == list(rows["resident"]["output_tokens"])
    assert bool(rows["specter"]["draft_compiled"])
    assert rows["specter"]["draft.backend"] == "fused_int4"
