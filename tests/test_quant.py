"""INT4 self-draft: packing, GPTQ against RTN, kernels against the reference, the shared
instance, and reuse of saved quantizations."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from specter.config import ModelConfig
from specter.models.introspect import experts_modules
from specter.models.loading import load_model
from specter.quant import calibrate, kernels
from specter.quant.formats import (QuantizedMatrix, effective_group, pack_codes, rtn_quantize,
                                   unpack_codes)
from specter.quant.gptq import Hessian, gptq_quantize, reconstruction_error


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (24, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    packed = pack_codes(q, bits)
    assert packed.numel() == q.numel() * (bits if bits != 3 else 8) // 8
    assert torch.equal(unpack_codes(packed, bits, (24, 64)), q)


def test_rtn_dequantizes_within_half_a_step():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    qm = rtn_quantize(w, 4, 128)
    step = qm.scales.repeat_interleave(128, dim=1)
    assert (w - qm.dequantize()).abs().le(step / 2 + 1e-6).all()
    assert effective_group(192, 128) == 64 and effective_group(96, 128) == 32
    assert effective_group(2048, 128) == 128 and effective_group(40, 128) == 40


def _correlated_inputs(n=2048, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) * torch.linspace(0.05, 2.0, d)  # uneven, correlated
    return torch.randn(n, 16, generator=g) @ torch.randn(16, d, generator=g) + \
        0.1 * torch.randn(n, d, generator=g) @ mix


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gptq_error_below_rtn_on_correlated_inputs(bits):
    x = _correlated_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    h = Hessian(128)
    h.add(x)
    gptq = reconstruction_error(w, gptq_quantize(w, h.h, bits, 32), h.h)
    rtn = reconstruction_error(w, rtn_quantize(w, bits, 32), h.h)
    assert gptq < 0.8 * rtn, (bits, gptq, rtn)
    # The objective is the mean squared output error on the inputs themselves.
    d = (w - rtn_quantize(w, bits, 32).dequantize()).double()
    assert rtn == pytest.approx(float(((x.double() @ d.T) ** 2).sum(1).mean() / 64), rel=1e-6)


def _random_layer(E=6, H=64, I=32, bits=4, group=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [rtn_quantize(torch.randn(2 * I, H, generator=g) / 8, bits, group) for _ in range(E)]
    down = [rtn_quantize(torch.randn(H, I, generator=g) / 8, bits, group) for _ in range(E)]
    return gate_up, down


def _act(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _routing(T=20, E=6, k=2, H=64, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    hidden = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return hidden, idx, weights


def test_reference_backend_equals_dequantized_experts():
    gate_up, down = _random_layer()
    hidden, idx, w = _routing()
    out = kernels.ReferenceExperts(gate_up, down, _act)(hidden, idx, w)
    expect = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = _act(hidden[t] @ gate_up[e].dequantize().T)
            expect[t] += w[t, j] * (h @ down[e].dequantize().T)
    assert torch.allclose(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_int4_backend_matches_reference(seed):
    gate_up, down = _random_layer(seed=seed)
    hidden, idx, w = _routing(seed=seed)
    ref = kernels.ReferenceExperts(gate_up, down, _act)(hidden, idx, w)
    out = kernels.CpuInt4Experts(gate_up, down, _act, torch.float32)(hidden, idx, w)
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


@pytest.mark.skipif(not kernels.triton_available(), reason="needs the triton package")
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_kernel_matches_reference_under_the_interpreter(seed, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gate_up, down = _random_layer(E=5, H=64, I=32, seed=seed)
    hidden, idx, w = _routing(T=11, E=5, k=2, H=64, seed=seed)  # not a multiple of BLOCK_M
    ref = kernels.ReferenceExperts(gate_up, down, _act)(hidden, idx, w)
    out = kernels.TritonExperts(gate_up, down, _act)(hidden, idx, w)
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


def test_align_blocks_groups_pairs_by_expert():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])  # T=3, k=2
    rows, block_expert = kernels.align_blocks(idx, 4)
    assert block_expert.tolist() == [0, 1, 2]
    # pair p = token p // k, slot p % k; within an expert (k-slot, token) order
    assert rows.view(3, 4).tolist() == [[2, 1, -1, -1], [3, 5, -1, -1], [0, 4, -1, -1]]
