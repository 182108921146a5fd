"""What GPTQ and the draft backends hold in memory, against the allocator's own count.

On the CPU the count is c10's CPU allocator as torch's profiler records it (every allocation
and free, kernels' internal temporaries included); on CUDA, `torch.cuda.memory_allocated`.
The real-width layer is DeepSeek-V2-Lite's (H 2048, I 1408) with two experts and random
weights, built from a transformers config (no checkpoint)."""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref

import pytest
import torch

from specter.models.introspect import experts_modules
from specter.quant import calibrate, gptq, kernels
from specter.quant.formats import QuantizedMatrix, rtn_quantize

H_LITE, I_LITE, E_LITE = 2048, 1408, 64  # DeepSeek-V2-Lite's routed experts


@dataclasses.dataclass
class Allocated:
    peak: int = 0  # most bytes allocated inside the block at once, beyond those at its start
    end: int = 0  # bytes allocated inside it and still held after it


@contextlib.contextmanager
def cpu_allocated():
    """The CPU allocator's count over the block: every allocation and free the profiler sees
    (blocks made before the block and freed inside it are not seen: an upper bound)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    res = Allocated()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield res
    deltas, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            deltas.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    total = 0
    for _, d in sorted(deltas):
        total += d
        res.peak = max(res.peak, total)
    res.end = total


def _deepseek(hidden: int, inter: int, experts: int, layers: int, dtype=torch.bfloat16):
    """A DeepSeek-V2 with every decoder layer MoE, `experts` routed experts (top-2), one
    shared expert, a small vocabulary and a narrow attention; random weights."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, max_position_embeddings=256, topk_method="greedy",
        n_group=None, topk_group=None)
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(cfg).to(dtype).eval()


def _windows(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (1, length), generator=g) for _ in range(n)]


# -- GPTQ --------------------------------------------------------------------------------------
def test_gptq_holds_one_layer_of_hessians_at_a_time(monkeypatch):
    """Over a two-MoE-layer model, the live Hessians never exceed one layer's (E for gate_up,
    E for down): the previous layer's are freed before the next layer's are made."""
    live: weakref.WeakSet = weakref.WeakSet()
    most = [0]
    init = gptq.Hessian.__init__

    def counted(self, *a, **k):
        init(self, *a, **k)
        live.add(self)
        most[0] = max(most[0], len(live))

    monkeypatch.setattr(gptq.Hessian, "__init__", counted)
    E = 4
    model = _deepseek(64, 32, E, layers=2, dtype=torch.float32)
    spec = calibrate.QuantSpec(method="gptq", bits=4, group=32, min_tokens=1)
    qe = calibrate.quantize_experts(model, spec, _windows(2, 32), torch.device("cpu"))
    assert len(qe.gate_up) == len(experts_modules(model)) == 2
    assert not any(any(layer) for layer in qe.meta["rtn_fallback"])  # every expert by GPTQ
    assert most[0] == 2 * E, most[0]
    assert len(live) == 0  # and none outlives the run


@pytest.mark.parametrize("out,cols,group", [
    pytest.param(2 * I_LITE, H_LITE, 128, marks=pytest.mark.slow),
    pytest.param(H_LITE, I_LITE, 128, marks=pytest.mark.slow),
    (704, 512, 128), (64, 1024, 128), (96, 200, 64)])
def test_gptq_working_bytes_bound_one_matrix(out, cols, group):
    """`gptq_working_bytes` against the allocator over one `gptq_quantize`: at DeepSeek-V2-Lite's
    gate_up and down and a narrower expert (the column sweep is the peak), a short wide matrix
    (making H's factors is) and a width the group does not divide."""
    g = torch.Generator().manual_seed(1)
    h = gptq.Hessian(cols)
    h.add(torch.randn(4 * cols, cols, generator=g))
    w = (torch.randn(out, cols, generator=g) / 32).to(torch.bfloat16)
    with cpu_allocated() as a:
        q = gptq.gptq_quantize(w, h.h, 4, group)
    stated = gptq.gptq_working_bytes(out, cols, group, 4)
    assert a.peak <= stated <= 1.05 * a.peak, (a.peak, stated)
    assert a.end == q.packed_bytes()  # what it returns is all it leaves


@pytest.mark.slow
def test_gptq_peak_on_a_real_width_layer():
    """One MoE layer at DeepSeek-V2-Lite's width (two experts) quantized on the CPU: the
    allocator's peak over `quantize_experts` stays within `gptq_peak_device_bytes` (the
    Hessians, one matrix's GPTQ, the finished codes held on the host) plus the calibration
    forward's own activations, and the statement is not loose."""
    E, T = 2, 32
    model = _deepseek(H_LITE, I_LITE, E, layers=1)
    windows = _windows(2, T)
    spec = calibrate.QuantSpec(method="gptq", bits=4, group=128, min_tokens=1, seq_len=T)
    with torch.no_grad(), cpu_allocated() as fwd:
        model(input_ids=windows[0], use_cache=False)
    with cpu_allocated() as run:
        qe = calibrate.quantize_experts(model, spec, windows, torch.device("cpu"))
    assert not any(qe.meta["rtn_fallback"][0])
    stated = calibrate.gptq_peak_device_bytes(E, H_LITE, I_LITE, 128, 4, weight_bytes=2,
                                              copied=False, tokens=T, results_held=True)
    hessians = 8 * E * (H_LITE ** 2 + I_LITE ** 2)
    assert hessians < run.peak <= stated + fwd.peak, (run.peak, stated, fwd.peak)
    assert stated <= 1.5 * run.peak, (run.peak, stated)


def test_gptq_peak_at_deepseek_v2_lite_is_one_layer_of_hessians_and_one_matrix():
    stated = calibrate.gptq_peak_device_bytes(E_LITE, H_LITE, I_LITE)
    hessians = 8 * E_LITE * (H_LITE ** 2 + I_LITE ** 2)
    assert hessians == 3_162_505_216
    work = gptq.gptq_working_bytes(2 * I_LITE, H_LITE, 128) + 2 * (2 * I_LITE) * H_LITE
    assert stated == hessians + work
    assert stated < 3.4e9  # not two layers' Hessians (6.3 GB)


@pytest.mark.cuda
def test_gptq_peak_on_cuda_with_the_experts_on_the_host():
    """The experts on the host, GPTQ on the GPU: each matrix is copied over only while it is
    quantized, and the allocator's peak stays within the statement (plus cuSOLVER's
    per-call workspace)."""
    from tqdm import tqdm

    dev = torch.device("cuda")
    E, T = 2, 32
    model = _deepseek(H_LITE, I_LITE, E, layers=1)
    spec = calibrate.QuantSpec(method="gptq", bits=4, group=128, min_tokens=1, seq_len=T)
    hess = calibrate.layer_hessians(model, 0, _windows(2, T), torch.device("cpu"))
    warm = torch.eye(64, dtype=torch.float64, device=dev)  # library handles and workspaces
    torch.cholesky_inverse(torch.linalg.cholesky(warm)) @ warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    for h in hess[0] + hess[1]:
        h.h = h.h.to(dev)
    with tqdm(disable=True) as bar:
        calibrate._quantize_layer(model, 0, spec, hess, bar, dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    stated = calibrate.gptq_peak_device_bytes(E, H_LITE, I_LITE, 128, 4, weight_bytes=2,
                                              copied=True, tokens=T)
    assert stated / 1.5 <= peak <= stated + 32 * 2**20, (peak, stated)


# -- what each draft backend holds -------------------------------------------------------------
def _reachable_bytes(obj) -> int:
    """Storage bytes of every tensor reachable from `obj` through attributes, lists, tuples,
    dicts and dataclasses, each storage once: a count that does not ask the backend."""
    seen_obj, storages, stack = set(), {}, [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen_obj:
            continue
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[(st.device, st.data_ptr())] = st.nbytes()
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dict__") and not isinstance(o, (type, types.FunctionType,
                                                            types.MethodType, types.ModuleType)):
            stack.extend(vars(o).values())
    return sum(storages.values())


def _act(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _layer(E=4, H=256, I=128, group=128, dtype=torch.bfloat16, seed=2):
    g = torch.Generator().manual_seed(seed)
    gu = [rtn_quantize((torch.randn(2 * I, H, generator=g) / 16).to(dtype), 4, group)
          for _ in range(E)]
    dn = [rtn_quantize((torch.randn(H, I, generator=g) / 16).to(dtype), 4, group)
          for _ in range(E)]
    return gu, dn


CPU_BACKENDS = ["reference", "cpu_int4", "gather_int4", "triton"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_each_backend_reports_what_it_holds_on_the_cpu(backend, dtype):
    """`nbytes()` of a backend layer built on the CPU equals what the allocator still holds
    from building it (its quantized inputs made in the same block and dropped) and the
    storages reachable from it."""
    if backend == "triton" and not kernels.triton_available():
        pytest.skip("needs triton")
    with cpu_allocated() as a:
        gu, dn = _layer(dtype=dtype)
        packed = sum(m.packed_bytes() for m in gu + dn)
        scale_bytes = sum(m.scales.numel() * m.scales.element_size() for m in gu + dn)
        layer = kernels.make_experts(backend, gu, dn, _act, dtype, device=torch.device("cpu"))
        del gu, dn
    assert layer.nbytes() == a.end == _reachable_bytes(layer), (layer.nbytes(), a.end)
    assert kernels.layers_nbytes([layer, layer]) == layer.nbytes()  # a storage once
    if backend in ("reference", "triton"):  # the format as it is
        assert layer.nbytes() == packed
    if backend == "cpu_int4":  # scales and zeros [K/g, N, 2] in `dtype`: the zeros added
        assert layer.nbytes() == packed + scale_bytes


def test_self_draft_device_bytes_are_the_backends():
    """The engine's draft device bytes (`DraftMode.draft_bytes`, a draft part's
    `device_bytes`) are what the backend layers hold: cpu_int4's fp32 scales and zeros
    included, more than the quantized format's packed size."""
    from specter.decoding.draft_mode import DraftMode

    model = _deepseek(64, 64, 4, layers=2, dtype=torch.float32)
    spec = calibrate.QuantSpec(method="rtn", bits=4, group=32)
    qe = calibrate.quantize_experts(model, spec, None, torch.device("cpu"))
    for backend in ("reference", "cpu_int4", "gather_int4"):
        sw = DraftMode(model, qe, backend)
        assert sw.draft_bytes == sum(_reachable_bytes(layer) for layer in sw.draft_layers)
        if backend == "reference":
            assert sw.draft_bytes == qe.packed_bytes()
        else:
            assert sw.draft_bytes > qe.packed_bytes()


def test_cuda_int4_bytes_at_deepseek_v2_lite():
    """`cuda_int4_bytes` against the shapes torch's CUDA INT4 packing really makes (its meta
    kernel, on the CPU) at DeepSeek-V2-Lite's gate_up and down: the packed codes and the bf16
    scales and zeros, the latter twice the format's bf16 scales."""
    for n, k in ((2 * I_LITE, H_LITE), (H_LITE, I_LITE)):
        qm = QuantizedMatrix(torch.empty(n, k // 2, dtype=torch.uint8, device="meta"),
                             torch.empty(n, k // 128, dtype=torch.bfloat16, device="meta"),
                             4, 128, (n, k))
        packed, sz = kernels._int4pack_cuda(qm)
        real = sum(t.numel() * t.element_size() for t in (packed, sz))
        assert kernels.cuda_int4_bytes(n, k, 128) == real
        assert real == n * k // 2 + 2 * (n * (k // 128) * 2)
    per_expert = sum(kernels.cuda_int4_bytes(n, k, 128)
                     for n, k in ((2 * I_LITE, H_LITE), (H_LITE, I_LITE)))
    assert per_expert == 4_595_712  # packed_bytes: 4_460_544


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["reference", "cuda_int4", "triton", "gather_int4"])
def test_each_backend_reports_what_it_allocates_on_cuda(backend):
    """`nbytes()` against the CUDA allocator's count over building a layer (each block
    rounded up to 512 bytes by the allocator), and cuda_int4's against `cuda_int4_bytes`."""
    if backend == "triton" and not kernels.triton_available():
        pytest.skip("needs triton")
    dev = torch.device("cuda")
    gu, dn = _layer(E=8, H=512, I=256)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    layer = kernels.make_experts(backend, gu, dn, _act, torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(dev) - base
    n_storages = len({t.untyped_storage().data_ptr() for t in layer.tensors()})
    assert layer.nbytes() <= allocated <= layer.nbytes() + 512 * n_storages, (layer.nbytes(),
                                                                              allocated)
    assert layer.nbytes() == _reachable_bytes(layer)
    if backend == "cuda_int4":
        assert layer.nbytes() == sum(kernels.cuda_int4_bytes(*m.shape, m.group) for m in gu + dn)
