"""The compiled draft step's formulations of DeepSeek-V2 (models/draft_step.py): the real
rotary embedding and the fused router compute transformers' layers (same math, other rounding),
are transformers' own code when off, and leave fewer kernels in the compiled step."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import interpreted
from specter.models import draft_step
from specter.quant import kernels


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


def test_the_step_computes_transformers_layers(tiny_models):
    """Prefill and a decode step over the static cache the compiled step uses: the logits of
    transformers' own layers within float rounding."""
    draft_step.install()
    model = tiny_models("tiny_deepseek").model
    ids = torch.tensor([[5, 17, 300, 42, 9, 77, 101, 3]])
    ref_cache = DynamicCache(config=model.config)
    ref = _logits(model, ids, ref_cache)
    static = StaticCache(config=model.config, max_cache_len=32)
    with draft_step.draft_step():
        got = _logits(model, ids, static)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    step = torch.tensor([[11]])
    ref2 = _logits(model, step, ref_cache)
    with draft_step.draft_step():
        got2 = _logits(model, step, static)
    torch.testing.assert_close(got2, ref2, rtol=1e-5, atol=1e-5)


def test_the_router_op_is_transformers_routing():
    torch.manual_seed(0)
    x, weight = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16)
    logits, w, i = torch.ops.specter.route_topk(x, weight, 6, 2.5, False)
    ref_logits = torch.nn.functional.linear(x.float(), weight.float())
    ref = torch.topk(torch.softmax(ref_logits, -1), 6, sorted=True)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(i, ref.indices) and torch.equal(w, ref.values * 2.5)


def test_off_it_is_transformers_own_code(tiny_models):
    draft_step.install()
    draft_step.install()  # once
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    rope, route = ds.apply_rotary_emb, ds.DeepseekV2TopkRouter.forward
    for f in (rope, route):
        assert f._specter_draft_step and not hasattr(f.__wrapped__, "_specter_draft_step")
    model = tiny_models("tiny_deepseek").model
    ids = torch.tensor([[5, 17, 300, 42]])
    through = _logits(model, ids, DynamicCache(config=model.config))
    ds.apply_rotary_emb, ds.DeepseekV2TopkRouter.forward = rope.__wrapped__, route.__wrapped__
    try:
        plain = _logits(model, ids, DynamicCache(config=model.config))
    finally:
        ds.apply_rotary_emb, ds.DeepseekV2TopkRouter.forward = rope, route
    assert torch.equal(through, plain)



ROUTER_CHECK = """
torch.manual_seed(1)
for T, E, H, k in ((1, 64, 2048, 6), (3, 60, 40, 4), (2, 16, 300, 2)):
    x, weight = torch.randn(T, H), torch.randn(E, H) / H ** 0.5
    launches.clear(); seen.clear()
    with Ops():
        logits, w, i = draft_step.route_topk._init_fn(x, weight, k, 1.5, True)
    assert len(launches) == DEVICE_LAUNCHES["specter::route_topk"] == 1, launches
    assert set(seen) <= {{"empty"}}, seen
    ref_logits = x @ weight.T
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    ref = torch.topk(torch.softmax(logits, -1), k, sorted=True)
    assert torch.equal(i, ref.indices), (i, ref.indices)
    torch.testing.assert_close(w, ref.values * 1.5, rtol=1e-6, atol=1e-7)
print("ok")
"""


MLA_CHECK = """
torch.manual_seed(2)
# (B, T, heads, dn, dr, dv, R, L, index, rot's batch): DeepSeek-V2-Lite's head widths, odd ones
for B, T, H, dn, dr, dv, R, L, idx, rb in ((1, 1, 2, 128, 64, 128, 512, 64, 37, 1),
                                           (2, 1, 3, 12, 8, 10, 24, 40, 0, 1),
                                           (2, 1, 2, 16, 4, 16, 20, 33, 32, 2)):
    q, kv = torch.randn(B, T, H * (dn + dr)), torch.randn(B, T, R + dr)
    norm_w, w_kvb = torch.rand(R) + 0.5, torch.randn(H * (dn + dv), R) / R ** 0.5
    ang = torch.randn(rb, T, dr // 2)
    rot = torch.stack((ang.cos(), ang.sin()), -1).contiguous()
    latent, pe, index = torch.randn(B, 1, L, R), torch.randn(B, 1, L, dr), torch.tensor(idx)
    args = lambda lat, p: (q, kv, norm_w, 1e-6, rot, lat, p, index, w_kvb, H, dn, dr, dv, 0.2)
    ref_lat, ref_pe = latent.clone(), pe.clone()
    ref = draft_step._mla_decode_torch(*args(ref_lat, ref_pe))
    launches.clear(); seen.clear()
    with Ops():
        out = draft_step.mla_decode._init_fn(*args(latent, pe), True)
    assert len(launches) == DEVICE_LAUNCHES["specter::mla_decode"] == 1, launches
    assert set(seen) <= {{"empty", "new_empty"}}, seen
    torch.testing.assert_close(latent, ref_lat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pe, ref_pe, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
print("ok")
"""


NORM_AND_GEMV_CHECK = """
torch.manual_seed(3)
F = torch.nn.functional
for rows, H, three, dtype, tol in ((1, 2048, True, torch.float32, 1e-5),
                                   (3, 200, False, torch.float32, 1e-5),
                                   (2, 256, True, torch.bfloat16, 2e-2)):
    x, z = torch.randn(rows, H).to(dtype), torch.randn(rows, H).to(dtype)
    y, w = torch.randn(rows, H), (torch.rand(H) + 0.5).to(dtype)  # y fp32: the routed sum
    launches.clear(); seen.clear()
    with Ops():
        total, normed = draft_step.add_rms_norm._init_fn(x, y, z if three else None, w, 1e-6,
                                                         True)
    assert len(launches) == DEVICE_LAUNCHES["specter::add_rms_norm"] == 1, launches
    assert set(seen) <= {{"empty_like", "new_empty", "promote_types"}}, seen  # no kernel
    ref_total, ref = draft_step._add_rms_norm_torch(x, y, z if three else None, w, 1e-6)
    torch.testing.assert_close(total.float(), ref_total.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(normed.float(), ref.float(), rtol=tol, atol=tol)
for T, I, N in ((1, 2816, 64), (2, 100, 37)):
    gu, w = torch.randn(1, T, 2 * I), torch.randn(N, I) / I ** 0.5
    launches.clear(); seen.clear()
    with Ops():
        out = draft_step.silu_mul_gemv._init_fn(gu, w, True)
    assert len(launches) == DEVICE_LAUNCHES["specter::silu_mul_gemv"] == 1, launches
    assert set(seen) <= {{"new_empty"}}, seen
    g, u = gu.chunk(2, -1)
    torch.testing.assert_close(out, F.linear(F.silu(g) * u, w), rtol=1e-4, atol=1e-4)
print("ok")
"""


def _interpreted(check: str) -> None:
    interpreted.run("from specter.models import draft_step\n" + check)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs the triton package")
def test_the_router_kernel_under_the_interpreter_is_one_launch():
    _interpreted(ROUTER_CHECK)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs the triton package")
def test_the_attention_kernel_under_the_interpreter_is_one_launch():
    """`specter::mla_decode` on CUDA: the cache written (normed latent, rotated key) as
    transformers writes it, and the heads' outputs computed absorbed within float rounding of
    transformers' own attention (the first position of a cache, and later ones), in one
    launch and no other kernel."""
    _interpreted(MLA_CHECK)


@pytest.mark.skipif(not kernels.triton_available(), reason="needs the triton package")
def test_the_norm_and_down_kernels_under_the_interpreter_are_one_launch_each():
    """`specter::add_rms_norm` (two or three terms, fp32 and bf16) and
    `specter::silu_mul_gemv` on CUDA: transformers' sums, norms and down projections within
    float rounding, one launch each and no other kernel."""
    _interpreted(NORM_AND_GEMV_CHECK)


def test_the_attention_op_is_transformers_attention(tiny_models, monkeypatch):
    """Decode steps over the draft's static cache with one write index (as the compiled step
    runs them): DeepSeek-V2's attention is the op (`specter::mla_decode`, its torch body on
    the CPU) and the logits are transformers' own within float rounding."""
    from specter.decoding.compiled_draft import one_write_index

    draft_step.install()
    calls = []
    body = draft_step._mla_decode_torch
    monkeypatch.setattr(draft_step, "_mla_decode_torch",
                        lambda *a: calls.append(a[7].item()) or body(*a))
    model = tiny_models("tiny_deepseek").model
    ids = torch.tensor([[5, 17, 300, 42, 9, 77, 101, 3]])
    ref_cache = DynamicCache(config=model.config)
    static = StaticCache(config=model.config, max_cache_len=32)
    _logits(model, ids, ref_cache)
    with draft_step.draft_step():
        _logits(model, ids, static)  # a prefill: transformers' attention (T > 1)
    assert not calls
    index = one_write_index(static)
    for n, tok in enumerate((11, 23, 7)):
        step = torch.tensor([[tok]])
        ref = _logits(model, step, ref_cache)
        with draft_step.draft_step():
            got = _logits(model, step, static)
        index.add_(1)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert calls[-1] == ids.shape[1] + n
    layers = model.config.num_hidden_layers
    assert len(calls) == 3 * layers


def test_the_compiled_step_has_fewer_kernels():
    """Counted as experiments.kernel_count counts (3 layers, narrow): 95 compiled kernels
    with transformers' layers as they were; the real rotary embedding (one a layer), the
    fused router (three a MoE layer), the routes left unstacked in the graph (one a MoE layer)
    and one write index for the draft cache (one a layer) left 82; the attention as one op
    (one launch for about ten kernels a layer: the latent's norm, the rotations, the cache
    writes, kv_b_proj over the cache, the key's and the query's assembly, the two products
    and the softmax), the merged projections (two a MoE layer) and the router as one op (one
    a MoE layer) leave 47."""
    from experiments.kernel_count import count

    row = count(3, True, log=lambda *_: None)
    assert row["compiled_kernels"] <= 47, row


def test_one_write_index_only_for_plain_static_layers(tiny_models):
    """The draft buffers' layers share one write index where each is transformers' plain
    StaticLayer; a sliding-window layer (its writes wrap around) keeps its own update."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    from specter.decoding.compiled_draft import one_write_index

    model = tiny_models("tiny_deepseek").model
    k = torch.zeros(1, 1, 2, 8)
    cache = StaticCache(config=model.config, max_cache_len=16)
    for layer in cache.layers:
        layer.lazy_initialization(k, k)
    index = one_write_index(cache)
    assert index is not None and all(l.cumulative_length is index for l in cache.layers)
    cache.layers[0].update(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8))
    assert int(index) == 0 and cache.layers[0].keys[0, 0, :2].eq(1).all()  # written, not moved
    mixed = StaticCache(config=model.config, max_cache_len=16)
    mixed.layers[1] = StaticSlidingWindowLayer(max_cache_len=16, sliding_window=4)
    for layer in mixed.layers:
        layer.lazy_initialization(k, k)
    assert one_write_index(mixed) is None
    assert type(mixed.layers[0]) is StaticLayer


def test_merged_projections_keep_the_target_and_its_bytes():
    """`merge_projections`: each attention's q and kv_a projections and each MLP's gate and
    up become views of one weight (no byte added), the target's logits stay bit for bit, and
    the draft step multiplies each merged pair in one GEMM (within float rounding)."""
    from specter.config import ModelConfig
    from specter.decoding.compiled_draft import one_write_index
    from specter.placement.loader import load_model

    draft_step.install()
    model = load_model(ModelConfig(name="tiny_deepseek", source="project"),
                       torch.device("cpu"), progress=False).model
    ids = torch.tensor([[5, 17, 300, 42, 9, 77, 101, 3]])
    before = _logits(model, ids, DynamicCache(config=model.config))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    attn = model.model.layers[1].self_attn
    shared = model.model.layers[1].mlp.shared_experts
    merged = draft_step.merge_projections(model)
    assert merged == 2 * model.config.num_hidden_layers  # every attention and every MLP
    assert draft_step.merge_projections(model) == 0  # once
    whole = getattr(attn, draft_step.MERGED)
    assert attn.q_proj.weight.data_ptr() == whole.data_ptr()
    assert attn.kv_a_proj_with_mqa.weight.untyped_storage().data_ptr() == whole.data_ptr()
    assert shared.up_proj.weight.untyped_storage().data_ptr() == getattr(
        shared, draft_step.MERGED).data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == nbytes
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) < len(storages)
    assert torch.equal(_logits(model, ids, DynamicCache(config=model.config)), before)
    static = StaticCache(config=model.config, max_cache_len=32)
    ref_cache = DynamicCache(config=model.config)
    _logits(model, ids, ref_cache)
    with draft_step.draft_step():
        _logits(model, ids, static)
    one_write_index(static)
    step = torch.tensor([[11]])
    with draft_step.draft_step():
        got = _logits(model, step, static)
    torch.testing.assert_close(got, _logits(model, step, ref_cache), rtol=1e-5, atol=1e-5)


def test_a_prepared_model_steps_as_transformers_layers(monkeypatch):
    """`prepare` (merged projections, chained norms): a decode step under the draft step's
    formulations runs each layer's adds and norms as `specter::add_rms_norm` (the last one the
    model's final norm), each MLP's activation and down projection as
    `specter::silu_mul_gemv`, and its logits are transformers' within float rounding."""
    from specter.config import ModelConfig
    from specter.decoding.compiled_draft import one_write_index
    from specter.placement.loader import load_model

    draft_step.install()
    model = load_model(ModelConfig(name="tiny_deepseek", source="project"),
                       torch.device("cpu"), progress=False).model
    draft_step.prepare(model)
    ids = torch.tensor([[5, 17, 300, 42, 9, 77, 101, 3]])
    ref_cache, static = DynamicCache(config=model.config), StaticCache(config=model.config,
                                                                         max_cache_len=32)
    _logits(model, ids, ref_cache)
    with draft_step.draft_step():
        _logits(model, ids, static)
    index = one_write_index(static)
    seen = []
    for name in ("add_rms_norm", "silu_mul_gemv"):
        body = getattr(draft_step, f"_{name}_torch")
        monkeypatch.setattr(draft_step, f"_{name}_torch",
                            lambda *a, _b=body, _n=name: seen.append(_n) or _b(*a))
    for tok in (11, 23):
        step = torch.tensor([[tok]])
        with draft_step.draft_step():
            got = _logits(model, step, static)
        index.add_(1)
        torch.testing.assert_close(got, _logits(model, step, ref_cache), rtol=1e-5, atol=1e-5)
    layers = model.config.num_hidden_layers
    assert seen.count("add_rms_norm") == 2 * 2 * layers
    assert seen.count("silu_mul_gemv") == 2 * layers  # the dense MLPs and the shared experts


def test_a_kernel_that_does_not_build_falls_back_to_its_torch_formulation(monkeypatch):
    """On a GPU where an op's Triton kernel does not build, the op says so once and runs its
    torch formulation from then on (the same values); other errors are not caught."""
    class Unbuilt(Exception):
        pass

    calls = []

    def launch(x, weight, k, scale):
        calls.append("launch")
        raise Unbuilt("no registers left")
    monkeypatch.setattr(kernels, "build_errors", lambda: (Unbuilt,))
    monkeypatch.setattr(draft_step, "_route_topk_launch", launch)
    monkeypatch.setattr(kernels, "UNBUILT", set())
    x, weight = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.warns(RuntimeWarning, match="route_topk: its Triton kernel does not build"):
        got = draft_step.route_topk._init_fn(x, weight, 2, 1.0, True)
    again = draft_step.route_topk._init_fn(x, weight, 2, 1.0, True)
    ref = draft_step._route_topk_torch(x, weight, 2, 1.0)
    assert calls == ["launch"]  # tried once
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and torch.equal(again[2], ref[2])
    monkeypatch.setattr(kernels, "UNBUILT", set())
    monkeypatch.setattr(draft_step, "_route_topk_launch",
                        lambda *a: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        draft_step.route_topk._init_fn(x, weight, 2, 1.0, True)
