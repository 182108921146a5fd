"""CUDA checks (skipped without a GPU): the same exactness on the device."""

from __future__ import annotations

import pytest
import torch

from specter.decoding.engines import resident_engine
from conftest import PROMPTS, TINY
from specter.config import ModelConfig
from specter.placement.loader import load_model


@pytest.mark.cuda
@pytest.mark.parametrize("name", TINY)
def test_resident_equals_generate_on_cuda(name):
    dev = torch.device("cuda")
    lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), dev, progress=False)
    engine = resident_engine(lm.model, dev)
    for text in PROMPTS:
        ids = lm.tokenizer(text)["input_ids"][:16]
        ours = engine.generate(ids, 24)
        ref = lm.model.generate(torch.tensor([ids], device=dev), max_new_tokens=24, do_sample=False)
        assert ours.tokens == ref[0, len(ids):].tolist()
        assert ours.peak_mem_source == "cuda_allocator" and ours.peak_mem_bytes > 0


@pytest.mark.cuda
@pytest.mark.parametrize("name", TINY)
def test_resident_batch_equals_generate_batch_on_cuda(name):
    """A left-padded batch of unequal prompts on the device: each row as `generate` pads it."""
    from specter.decoding.batch import pad_id

    dev = torch.device("cuda")
    lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), dev, progress=False)
    batch = [lm.tokenizer(t)["input_ids"][:6 + 3 * i] for i, t in enumerate(PROMPTS)]
    ours = [g.tokens for g in resident_engine(lm.model, dev, stop_on_eos=False)
            .generate_batch(batch, 16)]
    pad, width = pad_id(lm.model), max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
    lm.model.generation_config.eos_token_id = None
    ref = lm.model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                            pad_token_id=pad)
    assert ours == ref[:, width:].tolist()


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tiny_deepseek", "tiny_qwen"])
def test_transformers_offload_on_cuda_equals_resident_and_times_real_copies(name):
    from baselines.transformers_offload import TransformersOffloadEngine
    from specter.clock.timing import Timing

    dev = torch.device("cuda")
    ref_lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), dev, progress=False)
    lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), dev, progress=False)
    engine = TransformersOffloadEngine(lm.model, dev, Timing.wall(dev), slots=lm.spec.top_k)
    resident = resident_engine(ref_lm.model, dev)
    for text in PROMPTS:
        ids = lm.tokenizer(text)["input_ids"][:16]
        engine.reset()
        ours = engine.generate(ids, 24)
        assert ours.tokens == resident.generate(ids, 24).tokens
        assert ours.stats["offloaded_expert_layers"] > 0 and ours.stats["h2d_ms"] > 0
        assert ours.stats["n_transfers"] == ours.stats["offloaded_expert_layers"] * len(ours.tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-3)])
def test_triton_int4_kernel_matches_reference_on_cuda(dtype, tol):
    from specter.quant import kernels
    from specter.quant.formats import rtn_quantize

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    E, H, I, T, k = 16, 256, 128, 37, 4
    gate_up = [rtn_quantize(torch.randn(2 * I, H, generator=g) / 16, 4, 128).to(dev) for _ in range(E)]
    down = [rtn_quantize(torch.randn(H, I, generator=g) / 16, 4, 128).to(dev) for _ in range(E)]
    for qm in gate_up + down:
        qm.scales = qm.scales.to(dtype)

    def act(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    hidden = torch.randn(T, H, generator=g).to(dev, dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(dev)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(dev, dtype)
    ref = kernels.ReferenceExperts(gate_up, down, act)(hidden.float(), idx, w.float())  # same rounded inputs
    out = kernels.TritonExperts(gate_up, down, act)(hidden, idx, w).float()
    assert float((out - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("H,I", [(256, 128), (2048, 1408)])  # DeepSeek-V2-Lite's expert shape
def test_cuda_int4_tinygemm_matches_reference_on_cuda(H, I):
    """torch's CUDA INT4 GEMM per expert (backend cuda_int4) against dequantize-then-matmul:
    the packing (two codes a byte, the even column high) and the scales layout are right."""
    from specter.quant import kernels
    from specter.quant.formats import rtn_quantize

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    E, T, k = 8, 9, 2
    gate_up = [rtn_quantize(torch.randn(2 * I, H, generator=g) / 16, 4, 128).to(dev) for _ in range(E)]
    down = [rtn_quantize(torch.randn(H, I, generator=g) / 16, 4, 128).to(dev) for _ in range(E)]

    def act(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    hidden = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(dev)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(dev, torch.bfloat16)
    ref = kernels.ReferenceExperts(gate_up, down, act)(hidden.float(), idx, w.float())
    out = kernels.make_experts("cuda_int4", gate_up, down, act)(hidden, idx, w).float()
    assert float((out - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "cuda_int4", "gather_int4", "fused_int4",
                                     "reference"])
def test_the_draft_goes_to_the_device_once(backend):
    """An INT4 draft quantized on the host reaches the device layer by layer in its backend's
    layout: the allocator's peak while building it stays near one copy (tinygemm's
    scales-and-zeros double the scales: 1.5x allowed), not the two a device copy and then a
    stacked or packed one would take."""
    from specter.quant import kernels
    from specter.quant.formats import rtn_quantize

    if backend in ("triton", "fused_int4") and not kernels.triton_available():
        pytest.skip("needs triton")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    E, H, I, L = 16, 512, 256, 3
    layers = [([rtn_quantize(torch.randn(2 * I, H, generator=g) / 16, 4, 128) for _ in range(E)],
               [rtn_quantize(torch.randn(H, I, generator=g) / 16, 4, 128) for _ in range(E)])
              for _ in range(L)]
    packed = sum(m.packed_bytes() for gu, dn in layers for m in gu + dn)

    def act(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    built = [kernels.make_experts(backend, gu, dn, act, torch.bfloat16, device=dev)
             for gu, dn in layers]
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert peak <= 1.5 * packed + packed / L, (backend, peak, packed)
    assert all(m.codes.device.type == "cpu" for gu, dn in layers for m in gu + dn)
    del built


def _cuda_layer(E=16, H=256, I=128, seed=5):
    from specter.quant.formats import rtn_quantize

    g = torch.Generator().manual_seed(seed)
    gate_up = [rtn_quantize(torch.randn(2 * I, H, generator=g) / 16, 4, 128) for _ in range(E)]
    down = [rtn_quantize(torch.randn(H, I, generator=g) / 16, 4, 128) for _ in range(E)]
    return gate_up, down, g


def _silu_gate(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["gather_int4", "triton", "fused_int4"])
def test_a_graphed_draft_layer_replays_what_it_runs_eagerly(backend):
    """issue 25 item 1: a fixed-shape draft layer captured once per call shape and replayed
    gives the eager call's output bit for bit, for routings it was not captured with, and on
    replay issues one launch, the copies in and out, and no sync."""
    from specter.counting import OpCounter
    from specter.quant import kernels

    if backend in ("triton", "fused_int4") and not kernels.triton_available():
        pytest.skip("needs triton")
    dev = torch.device("cuda")
    gate_up, down, g = _cuda_layer()
    eager = kernels.make_experts(backend, gate_up, down, _silu_gate, torch.bfloat16, device=dev)
    graphed = kernels.make_experts(backend, gate_up, down, _silu_gate, torch.bfloat16, device=dev,
                                   graphs=True)
    for T in (1, 2, 1, 2):
        hidden = torch.randn(T, 256, generator=g).to(dev, torch.bfloat16)
        idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(T)]).to(dev)
        w = torch.softmax(torch.randn(T, 4, generator=g), -1).to(dev, torch.bfloat16)
        want = eager(hidden, idx, w)
        with OpCounter(cpu_run=False) as counter:
            got = graphed(hidden, idx, w)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert len(graphed.graphs) == 2  # one per call shape
    c = counter.counts["bookkeeping"]  # the last call: a replay
    assert c["syncs"] == 0 and c["host_reads"] == 0 and c["launching"] <= 6, c


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [True, False])
def test_fused_int4_on_cuda_matches_the_reference_eager_and_compiled(gated):
    """fused_int4's two Triton launches (silu-gated in the kernel, or the activation in torch
    between its two ops) against the reference in bf16, eagerly and under inductor."""
    from specter.quant import kernels

    if not kernels.triton_available():
        pytest.skip("needs triton")
    dev = torch.device("cuda")
    gate_up, down, g = _cuda_layer(E=64)
    fused = kernels.make_experts("fused_int4", gate_up, down, _silu_gate, torch.bfloat16,
                                 device=dev)
    assert fused.use_triton
    fused.gated = gated
    ref_layer = kernels.ReferenceExperts(gate_up, down, _silu_gate)
    compiled = torch.compile(fused.__call__, fullgraph=True)
    for T in (1, 2):
        hidden = torch.randn(T, 256, generator=g).to(dev, torch.bfloat16)
        idx = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(T)]).to(dev)
        w = torch.softmax(torch.randn(T, 6, generator=g), -1).to(dev, torch.bfloat16)
        ref = ref_layer(hidden.float().cpu(), idx.cpu(), w.float().cpu())
        for out in (fused(hidden, idx, w), compiled(hidden, idx, w)):
            err = float((out.float().cpu() - ref).abs().max() / ref.abs().max())
            assert err < 2e-2, (T, err)


@pytest.mark.cuda
def test_specter_with_graphed_drafts_equals_resident_on_cuda(tmp_path):
    """The whole system with quant.graphs=on: token-identical to resident on CUDA (an RTN
    draft, as the other runner tests here: verification makes any draft lossless, and GPTQ's
    calibration was most of this test's 18 s on an H200)."""
    from experiments import records, runner
    from specter.settings import run_config

    tokens = {}
    for system, extra in (("resident", []), ("specter", ["quant.backend=gather_int4",
                                                          "quant.graphs=on"])):
        runner.run(run_config(["model=tiny_deepseek", "hardware=cuda", f"system={system}",
                               "workload.items=2", "workload.max_new_tokens=24",
                               "workload.stop_on_eos=false", "spec.k=4", "progress=false",
                               "quant.method=rtn", f"out_dir={tmp_path / system}", *extra]),
                   log=lambda *_: None)
        df = records.load(tmp_path / system).sort_values("request_id")
        tokens[system] = df["output_tokens"].map(tuple).tolist()
        if system == "specter":  # per-layer graphs asked: spec.compile=auto says it stays eager
            assert df["draft.graphs"].all() and not df["draft_compiled"].any()
            assert df["draft_compile"].str.contains("quant.graphs=on").all()
    assert tokens["specter"] == tokens["resident"]


def _tiny_rows_on_cuda(out, system: str, extra: list[str]):
    """tiny_deepseek's rows for `system` in real CUDA time, 2 items x 24 tokens, K = 4, by
    request."""
    from experiments import records, runner
    from specter.settings import run_config

    runner.run(run_config(["model=tiny_deepseek", "hardware=cuda", f"system={system}",
                           "workload.items=2", "workload.max_new_tokens=24",
                           "workload.stop_on_eos=false", "spec.k=4", "progress=false",
                           "quant.method=rtn", f"out_dir={out}", *extra]),
               log=lambda *_: None)
    return records.load(out).sort_values("request_id")


@pytest.mark.cuda
def test_captured_steps_equal_eager_ones_on_cuda(tmp_path):
    """issue 36 item 5, issue 45 item 3: spec.compile=on and system.compile=on on CUDA capture
    the step (the draft: the whole step as one CUDA graph over its static cache, captured in
    the runner's untimed warm-up; resident: its decode step the same way, issue 45 item 6); the
    tokens are the eager ones, and every row says the step was captured. The defaults
    (spec.compile=auto, system.compile=auto) capture too, the draft with per-layer graphs off;
    specmoeoff's second instance as well."""
    tokens = {}
    for i, (system, extra) in enumerate((
            ("resident", ["system.compile=off"]),
            ("resident", ["system.compile=on"]),
            ("resident", ["system.compile=auto"]),
            ("specter", ["spec.compile=off"]),
            ("specter", ["spec.compile=on", "quant.backend=gather_int4"]),
            ("specter", ["spec.compile=auto"]),
            ("specmoeoff", ["spec.compile=auto"]))):
        # no '=' in a path (the runner parses overrides)
        df = _tiny_rows_on_cuda(tmp_path / f"run{i}-{system}", system, extra)
        tokens[(system, extra[0])] = df["output_tokens"].map(tuple).tolist()
        if not extra[0].endswith("=off"):
            kind = "draft" if system != "resident" else "decode"
            assert df[f"{kind}_captured"].all() and (df["compile_warmup_s"] > 0).all(), \
                (system, extra, df.get(f"{kind}_compile"))
            if kind == "draft":  # the whole step, not its layers; no capture in a timed request
                assert not df["draft.graphs"].any()
                assert df["draft_compile"].str.contains("one CUDA graph").all()
                assert (df["draft_compiles"] == 0).all()
            else:  # resident: the same capture (issue 45 item 6)
                assert df["decode_compile"].str.contains("one CUDA graph").all()
                assert (df["decode_compiles"] == 0).all()
    assert len(set(map(tuple, tokens.values()))) == 1, tokens


@pytest.mark.cuda
def test_a_draft_step_that_cannot_be_captured_graphs_its_layers_on_cuda(tmp_path):
    """issue 45 item 3: where spec.compile=auto cannot capture the step (specter without
    sharing: a per-window copy of the target's KV), the row says so, the draft layers are
    replayed as CUDA graphs instead (captured at build time), and the tokens are resident's."""
    tokens = {}
    for system, extra in (("resident", []), ("specter", ["system.shared=false"])):
        df = _tiny_rows_on_cuda(tmp_path / system, system, extra)
        tokens[system] = df["output_tokens"].map(tuple).tolist()
        if system == "specter":
            assert not df["draft_compiled"].any()
            assert df["draft_compile"].str.contains("per-window copy").all()
            assert df["draft.graphs"].all() and (df["draft.backend"] == "gather_int4").all()
            assert df["draft.graphs_choice"].str.contains("step stays eager").all()
    assert tokens["specter"] == tokens["resident"]


@pytest.mark.cuda
def test_the_cuda_clock_marks_without_waiting():
    """`CudaLink.mark` records an event (no device sync); `elapsed` answers None until the
    device reaches the end mark, then the span in seconds, and waits only when asked."""
    from specter.counting import OpCounter
    from specter.clock.timing import make_link
    from specter.offload.link import LinkProfile

    dev = torch.device("cuda")
    link = make_link("cuda", LinkProfile(bandwidth_Bps=1e10, latency_s=0.0), dev)
    x = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    with OpCounter(cpu_run=False) as counter:
        start = link.mark()
        for _ in range(20):
            x = x @ x / 64
        end = link.mark()
        early = link.elapsed(start, end)
    assert counter.counts["bookkeeping"]["syncs"] == 0
    seconds = link.elapsed(start, end, wait=True)
    assert seconds > 0 and (early is None or early == pytest.approx(seconds))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_grouped_experts_on_cuda_match_the_loop(dtype, tmp_path):
    """The device's fixed-launch kernels (offload/grouped.py: torch's grouped GEMM in bfloat16
    on compute capability 9.x/10.x, the padded one elsewhere and on request) decode the tokens
    the per-expert loop decodes (kernels of their own: equal tokens, not equal bits), with
    misses streaming through 8 slots."""
    from experiments import records, runner
    from specter.settings import run_config
    from specter.offload.grouped import pick_kernel

    auto = pick_kernel(torch.device("cuda"), getattr(torch, dtype))
    tokens = {}
    for grouped, kernel in (("auto", auto), ("padded", "padded"), ("false", "loop")):
        runner.run(run_config(["model=tiny_deepseek", f"model.dtype={dtype}", "hardware=cuda",
                               "system=lru", "budget.slots=8", "workload.items=2",
                               "workload.max_new_tokens=24", "workload.stop_on_eos=false",
                               f"offload.grouped={grouped}", "progress=false",
                               f"out_dir={tmp_path / grouped}"]), log=lambda *_: None)
        df = records.load(tmp_path / grouped).sort_values("request_id")
        assert (df["experts_kernel"] == kernel).all(), (grouped, df["experts_kernel"].tolist())
        tokens[grouped] = df["output_tokens"].map(tuple).tolist()
    assert tokens["auto"] == tokens["false"] and tokens["padded"] == tokens["false"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_the_draft_attention_kernels_match_transformers_on_cuda(dtype, tol):
    """`specter::mla_decode`'s Triton launch (models/triton_draft.py) against its torch
    body (transformers' attention) at DeepSeek-V2-Lite's head widths, on the device."""
    from specter.models import draft_step

    dev, dt = torch.device("cuda"), getattr(torch, dtype)
    torch.manual_seed(0)
    B, T, H, dn, dr, dv, R, L, idx = 1, 1, 16, 128, 64, 128, 512, 256, 140
    q, kv = torch.randn(B, T, H * (dn + dr), device=dev, dtype=dt), torch.randn(
        B, T, R + dr, device=dev, dtype=dt)
    norm_w = (torch.rand(R, device=dev) + 0.5).to(dt)
    w_kvb = (torch.randn(H * (dn + dv), R, device=dev) / R ** 0.5).to(dt)
    ang = torch.randn(1, T, dr // 2, device=dev)
    rot = torch.stack((ang.cos(), ang.sin()), -1).contiguous()
    latent = torch.randn(B, 1, L, R, device=dev, dtype=dt)
    pe = torch.randn(B, 1, L, dr, device=dev, dtype=dt)
    index = torch.tensor(idx, device=dev)
    outs = []
    for use_triton in (False, True):
        lat, p = latent.clone(), pe.clone()
        out = torch.ops.specter.mla_decode(q, kv, norm_w, 1e-6, rot, lat, p, index, w_kvb, H,
                                           dn, dr, dv, 0.1, use_triton)
        outs.append((out.float(), lat.float(), p.float()))
    for got, ref in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
