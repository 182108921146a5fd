"""INT4 quantization: packing, GPTQ against RTN, kernels against the reference, and reuse of
saved quantizations (the self-draft that runs them: test_decoding.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specter.config import ModelConfig
from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.placement.loader import load_model
from specter.quant import calibrate, kernels
from specter.quant.formats import effective_group, pack_codes, rtn_quantize, unpack_codes
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


@pytest.mark.parametrize("T", [1, 2, 11])  # 2 and 6 pairs: gathered; 22 pairs > 6 experts: by expert
def test_gather_int4_backend_matches_reference(T):
    gate_up, down = _random_layer(seed=T)
    hidden, idx, w = _routing(T=T, seed=T)
    ref = kernels.ReferenceExperts(gate_up, down, _act)(hidden, idx, w)
    out = kernels.GatherInt4Experts(gate_up, down, _act, torch.float32)(hidden, idx, w)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_gather_int4_issues_the_same_operations_whatever_the_routing():
    """The draft step's shape: the same aten operations for every routing, none reading the
    device (what a CUDA graph needs)."""
    from specter.counting import OpCounter

    class Trace(OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return super().__torch_dispatch__(func, types, args, kwargs)

    def trace(experts, seed):
        with Trace() as counter:
            counter.seen = []
            experts(*_routing(T=2, seed=seed))
        return counter.seen, counter.counts["bookkeeping"]

    gate_up, down = _random_layer()
    gather = kernels.GatherInt4Experts(gate_up, down, _act, torch.float32)
    per_expert = kernels.CpuInt4Experts(gate_up, down, _act, torch.float32)
    traces = []
    for seed in range(3):
        seen, c = trace(gather, seed)
        assert c["syncs"] == 0 and c["host_reads"] == 0, c
        traces.append(seen)
        _, c_per_expert = trace(per_expert, seed)  # one read of the routing, then per expert
        assert c_per_expert["host_reads"] == 1 and c["launching"] < c_per_expert["launching"]
    assert traces[0] == traces[1] == traces[2]


TRITON_CHECK = """
import torch, sys
sys.path[:0] = [{tests!r}]
from test_quant import _random_layer, _routing, _act
from specter.quant import kernels
worst = 0.0
for seed in (0, 1, 2):
    gate_up, down = _random_layer(E=5, H=64, I=32, seed=seed)
    hidden, idx, w = _routing(T=11, E=5, k=2, H=64, seed=seed)  # 22 rows: not whole blocks
    ref = kernels.ReferenceExperts(gate_up, down, _act)(hidden, idx, w)
    out = kernels.TritonExperts(gate_up, down, _act)(hidden, idx, w)
    worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
print("max relative error", worst)
assert worst < 1e-3, worst
worst16 = 0.0  # bf16 activations and scales (the reference sees the same rounded inputs)
for seed in (0, 1, 2):
    gate_up, down = _random_layer(E=5, H=64, I=32, seed=seed)
    for qm in gate_up + down:
        qm.scales = qm.scales.to(torch.bfloat16)
    hidden, idx, w = _routing(T=11, E=5, k=2, H=64, seed=seed)
    hb, wb = hidden.to(torch.bfloat16), w.to(torch.bfloat16)
    ref = kernels.ReferenceExperts(gate_up, down, _act)(hb.float(), idx, wb.float())
    out = kernels.TritonExperts(gate_up, down, _act)(hb, idx, wb).float()
    worst16 = max(worst16, float((out - ref).abs().max() / ref.abs().max()))
print("bf16 max relative error", worst16)
assert worst16 < 1e-2, worst16
"""


@pytest.mark.skipif(not kernels.triton_available(), reason="needs the triton package")
def test_triton_kernel_matches_reference_under_the_interpreter():
    """The fused kernel on the CPU through Triton's interpreter (fresh process: the
    interpreter must be chosen before triton is first imported): fp32 within 1e-3, bf16
    within 1e-2 of the dequantize-then-matmul reference."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TRITON_INTERPRET="1")
    code = TRITON_CHECK.format(tests=str(Path(__file__).parent))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).parents[1], timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max relative error" in res.stdout


def test_align_blocks_groups_pairs_by_expert():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])  # T=3, k=2
    rows, block_expert = kernels.align_blocks(idx, 4, num_experts=3)
    # fixed shape: 6 pairs + 3 experts x 3 padding rows -> 4 blocks; the last holds nothing
    assert block_expert.tolist() == [0, 1, 2, 2]
    # pair p = token p // k, slot p % k; within an expert (k-slot, token) order
    assert rows.view(4, 4).tolist() == [[2, 1, -1, -1], [3, 5, -1, -1], [0, 4, -1, -1],
                                        [-1, -1, -1, -1]]
    # an expert nobody chose takes no block; the shape is the same whatever the routing
    rows2, experts2 = kernels.align_blocks(torch.tensor([[0, 2], [0, 2], [2, 0]]), 4, 3)
    assert rows2.shape == rows.shape and experts2.tolist() == [0, 2, 2, 2]
    assert rows2.view(4, 4).tolist()[:2] == [[0, 2, 5, -1], [4, 1, 3, -1]]


# -- on project-made models ------------------------------------------------------------------
def _tiny(name="tiny_qwen"):
    return load_model(ModelConfig(name=name, source="project", dtype="float32"),
                      torch.device("cpu"), progress=False)


SMALL_SPEC = calibrate.QuantSpec(method="gptq", bits=4, group=32, calib_tokens=1024)


def test_quantized_experts_are_saved_reused_and_rebuilt_when_the_source_changes(tmp_path):
    lm = _tiny()
    qe, path, reused = calibrate.ensure_quantized(lm.model, lm.tokenizer, SMALL_SPEC, tmp_path,
                                                  torch.device("cpu"))
    assert not reused and (path / "quant.json").exists()
    layers = len(experts_modules(lm.model))
    assert sorted(f.name for f in path.glob("layer*.safetensors")) == \
        sorted(f"layer{l}.safetensors" for l in range(layers))  # one file a layer
    again, path2, reused2 = calibrate.ensure_quantized(lm.model, lm.tokenizer, SMALL_SPEC,
                                                       tmp_path, torch.device("cpu"))
    assert reused2 and path2 == path
    assert again.meta["source_checksum"] == qe.meta["source_checksum"]
    for a, b in zip(qe.gate_up[1] + qe.down[2], again.gate_up[1] + again.down[2]):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    with torch.no_grad():  # the source weights change: a new quantization, not the old file
        experts_modules(lm.model)[0][1].down_proj[3].mul_(1.01)
    _, path3, reused3 = calibrate.ensure_quantized(lm.model, lm.tokenizer, SMALL_SPEC, tmp_path,
                                                   torch.device("cpu"))
    assert not reused3 and path3 != path
    _, path4, reused4 = calibrate.ensure_quantized(  # another spec: another file
        lm.model, lm.tokenizer, calibrate.QuantSpec(method="rtn", bits=4, group=32), tmp_path,
        torch.device("cpu"))
    assert not reused4 and path4 not in (path, path3)


def test_gptq_experts_see_only_their_routed_tokens_and_fall_back_to_rtn():
    lm = _tiny()
    spec = calibrate.QuantSpec(method="gptq", bits=4, group=32, calib_tokens=256, min_tokens=40)
    windows = calibrate.calibration_windows(lm.tokenizer, spec)
    assert sum(w.shape[1] for w in windows) == 256
    qe = calibrate.quantize_experts(lm.model, spec, windows, torch.device("cpu"))
    tokens, fallback = qe.meta["calib_tokens_per_expert"], qe.meta["rtn_fallback"]
    k = lm.spec.top_k
    assert all(sum(layer) == 256 * k for layer in tokens)  # each token reaches k experts
    flat = [(n, fb) for tl, fl in zip(tokens, fallback) for n, fb in zip(tl, fl)]
    assert all(fb == (n < 40) for n, fb in flat) and any(fb for _, fb in flat)
    _, m = experts_modules(lm.model)[0]
    e = next(i for i, fb in enumerate(fallback[0]) if fb)
    rtn = rtn_quantize(m.gate_up_proj[e].detach(), 4, 32)
    assert torch.equal(qe.gate_up[0][e].codes, rtn.codes)


@pytest.mark.skipif(not __import__("specter.quant.gptq_import", fromlist=["x"]).gptqmodel_available(),
                    reason="needs gptqmodel (make setup installs it)")
def test_builtin_gptq_within_ten_percent_of_gptqmodel(tmp_path):
    """Same tiny model, same calibration windows, plain GPTQ on both sides: the built-in
    GPTQ's reconstruction error, summed and per matrix, within 10% of gptqmodel's or better;
    gptqmodel's checkpoint imports into the INT4 layout (the errors are computed from it)."""
    from experiments.crosscheck_gptq import crosscheck

    df = crosscheck("tiny_qwen", group=32, calib_tokens=2048, cache_dir=None)
    assert len(df) > 100
    ratio = df["ours"] / df["gptqmodel"]
    assert df["ours"].sum() <= 1.1 * df["gptqmodel"].sum()
    assert ratio.median() <= 1.1
    assert (df["rtn"].sum() > 3 * df["gptqmodel"].sum())  # the import is GPTQ, not garbage


@pytest.mark.slow
def test_fidelity_experiment_records_routing_agreement_by_bits(tmp_path):
    """`experiment=fidelity` on a tiny model at 2 and 8 bits: records with per-layer and
    per-position top-k agreement; 8-bit routes (almost) like the target, 2-bit less;
    the table script reads them back."""
    import subprocess
    import sys

    from conftest import REPO, run_cli
    from experiments import records

    out = tmp_path / "fid"
    res = run_cli("-m", "experiment=fidelity", "model=tiny_qwen", "dataset=humaneval",
                  "workload.items=2", "workload.max_new_tokens=12", "quant.group=32",
                  "quant.calib_tokens=512", "quant.method=gptq", "quant.bits=2,8",
                  f"out_dir={out}", "progress=false")
    assert res.returncode == 0, res.stderr
    df = records.load(out)
    assert len(df) == 4 and set(df["draft.bits"]) == {2, 8}
    n_moe = 3
    for _, r in df.iterrows():
        assert len(r["fidelity_per_layer"]) == n_moe
        assert len(r["fidelity_per_position"]) == len(r["output_tokens"]) == r["fidelity_positions"]
        assert 0 <= r["fidelity_topk"] <= 1 and 0 <= r["draft_token_match"] <= 1
    by_bits = df.groupby("draft.bits")["fidelity_topk"].mean()
    assert by_bits[8] > 0.99 and by_bits[2] < by_bits[8]  # 2 bits visibly moves the routing
    first = df["fidelity_per_layer"].map(lambda v: v[0])
    assert (first == 1.0).all()  # the first MoE layer's router sees no quantized expert yet
    assert (df["draft.backend"] == "reference").all()  # 2 and 8 bits: no INT4 kernel
    table = subprocess.run([sys.executable, "-m", "experiments.fidelity_table", str(out)],
                           cwd=REPO, capture_output=True, text=True)
    assert table.returncode == 0 and "SUMMARY" in table.stdout, table.stderr


def test_gptq_saves_each_layer_and_resumes_where_it_was_interrupted(tiny_models, tmp_path,
                                                                    monkeypatch):
    """A quantization stopped inside its second MoE layer keeps the first, saved whole; the
    rerun quantizes only what is left and gives what one uninterrupted run gives."""
    lm = tiny_models("tiny_deepseek")
    cpu = torch.device("cpu")
    spec = calibrate.QuantSpec(calib_tokens=256, group=32)
    windows = calibrate.calibration_windows(lm.tokenizer, spec)
    whole = calibrate.quantize_experts(lm.model, spec, windows, cpu)
    partial, real, calls = tmp_path / "partial", calibrate._quantize_layer, []

    def counted(model, l, *args):
        calls.append(l)
        if len(calls) == 2 and stop:
            raise KeyboardInterrupt  # the user's Ctrl-C, inside layer 2
        return real(model, l, *args)

    monkeypatch.setattr(calibrate, "_quantize_layer", counted)
    stop = True
    with pytest.raises(KeyboardInterrupt):
        calibrate.quantize_experts(lm.model, spec, windows, cpu, partial=partial)
    assert (partial / "layer0.safetensors").is_file()
    assert not (partial / "layer1.safetensors").exists()
    stop, calls[:] = False, []
    again = calibrate.quantize_experts(lm.model, spec, windows, cpu, partial=partial)
    n_layers = len(whole.gate_up)
    assert again.meta["resumed_layers"] == 1 and len(calls) == n_layers - 1
    for a, b in zip(whole.gate_up + whole.down, again.gate_up + again.down):
        assert all(torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales)
                   for x, y in zip(a, b))
    assert again.meta["rtn_fallback"] == whole.meta["rtn_fallback"]
    other = calibrate.QuantSpec(calib_tokens=256, group=64)  # another spec: nothing reused
    calls[:] = []
    assert calibrate.quantize_experts(lm.model, other, windows, cpu,
                                      partial=partial).meta["resumed_layers"] == 0


def _gptq_pack(codes: torch.Tensor, zero: int, scales: torch.Tensor, group: int) -> dict:
    """One linear in the AutoGPTQ / GPTQModel layout, packed as their published format packs
    it (4 bits, 8 codes per int32, lowest bits first): `qweight` [in / 8, out] packed along
    the input, `qzeros` [groups, out / 8] holding zero - 1 ("gptq" v1 checkpoints), `scales`
    [groups, out] in fp16, `g_idx` [in] (no act-order: input column i is in group i // g)."""
    out_f, in_f = codes.shape
    shifts = torch.arange(8, dtype=torch.int64) * 4
    q = codes.T.to(torch.int64).reshape(in_f // 8, 8, out_f)  # [in/8, 8, out]
    qweight = (q << shifts.view(1, 8, 1)).sum(1)
    z = torch.full((in_f // group, out_f), zero - 1, dtype=torch.int64).reshape(-1, out_f // 8, 8)
    qzeros = (z << shifts.view(1, 1, 8)).sum(-1)
    as_int32 = lambda t: (t & 0xFFFFFFFF).to(torch.int64).where(  # noqa: E731
        t < 2**31, t - 2**32).to(torch.int32)
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros),
            "scales": scales.T.contiguous().to(torch.float16),
            "g_idx": (torch.arange(in_f) // group).to(torch.int32)}


def write_gptq_checkpoint(lm, folder, shards: int = 1, zero: int = 8) -> dict:
    """A GPTQ INT4 checkpoint of `lm`'s routed experts in the GPTQModel / AutoGPTQ layout
    (random codes, group 32, the settings in config.json's quantization_config), its MoE
    layers split over `shards` safetensors files; returns each linear's dequantized weights."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    mods = experts_modules(lm.model)
    files: list[dict] = [{} for _ in range(shards)]
    truth = {}
    for i, (layer, mod) in enumerate(mods):
        tensors = files[i * shards // len(mods)]
        n_exp, two_i, hidden = mod.gate_up_proj.shape
        for e in range(n_exp):
            for name, shape in (("gate_proj", (two_i // 2, hidden)), ("up_proj", (two_i // 2, hidden)),
                                ("down_proj", (hidden, two_i // 2))):
                codes = torch.randint(0, 16, shape, generator=g)
                scales = (torch.rand(shape[0], shape[1] // 32, generator=g) + 0.5) / 100
                prefix = f"model.layers.{layer}.mlp.experts.{e}.{name}"
                tensors.update({f"{prefix}.{k}": v for k, v in
                                _gptq_pack(codes, zero, scales, 32).items()})
                # (q - 8) x scale, in the checkpoint's fp16 as the importer keeps its scales
                truth[prefix] = ((codes - 8).half() * scales.half().repeat_interleave(32, 1)).float()
    folder.mkdir(parents=True)
    for i, tensors in enumerate(files):
        name = "model.safetensors" if shards == 1 else \
            f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(folder / name))
    cfg = json.loads((lm.checkpoint / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return truth


def _whole_gptq_import(folder, model, dtype=None):
    """The GPTQ import as it was before it read a layer at a time: every file loaded at once,
    every linear's codes unpacked (an int32 a code) and packed again, gate and up fused by
    unpacking both, every expert of every layer in memory; (gate_up, down) per layer."""
    from safetensors.torch import load_file

    from specter.quant.formats import QuantizedMatrix
    from specter.quant.gptq_import import NAMES, _unpack_int32

    def linear(prefix):
        codes = _unpack_int32(tensors[f"{prefix}.qweight"], 4, dim=0).T.contiguous()
        return QuantizedMatrix(pack_codes(codes.to(torch.uint8), 4),
                               tensors[f"{prefix}.scales"].T.contiguous(), 4, 32,
                               tuple(codes.shape))

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    gate_up, down = [], []
    for layer, mod in experts_modules(model):
        gl, dl = [], []
        for e in range(mod.gate_up_proj.shape[0]):
            g, u, d = (linear(f"model.layers.{layer}.mlp.experts.{e}.{n}") for n in NAMES[0])
            fused = QuantizedMatrix(pack_codes(torch.cat([g.unpacked(), u.unpacked()]), 4),
                                    torch.cat([g.scales, u.scales]), 4, 32,
                                    (g.shape[0] + u.shape[0], g.shape[1]))
            if dtype is not None:
                fused.scales, d.scales = fused.scales.to(dtype), d.scales.to(dtype)
            gl.append(fused)
            dl.append(d)
        gate_up.append(gl)
        down.append(dl)
    return gate_up, down


@pytest.mark.parametrize("dtype,byteorder", [(None, "little"), (torch.bfloat16, "little"),
                                             (None, "big")])
def test_the_gptq_import_read_a_layer_at_a_time_is_the_whole_import(tiny_models, tmp_path,
                                                                    monkeypatch, dtype, byteorder):
    """`import_gptq` reads each MoE layer from the checkpoint's files when it is asked for
    (`GptqLayers`, two shards here), its codes the GPTQ words' bytes as they are: the same
    codes, scales (dtype included), groups, shapes and packed bytes as the whole import it
    replaces, also into a model whose experts `HostExpertStore.from_model` moved into the
    host store (its fused parameters empty), and on a big-endian host (the words unpacked and packed again); a checkpoint
    with asymmetric zero points is still refused when it is imported, before any layer is
    read."""
    from types import SimpleNamespace

    from specter.offload.store import HostExpertStore
    from specter.quant import gptq_import
    from specter.quant.gptq_import import import_gptq

    monkeypatch.setattr(gptq_import, "sys", SimpleNamespace(byteorder=byteorder))

    lm = tiny_models("tiny_deepseek")
    folder = tmp_path / "gptq"
    write_gptq_checkpoint(lm, folder, shards=2)
    qe = import_gptq(folder, lm.model, dtype)
    whole = _whole_gptq_import(folder, lm.model, dtype)
    assert isinstance(qe.gate_up, calibrate.SavedLayers) and len(qe.gate_up) == len(whole[0])
    assert qe.groups() == {32}
    assert qe.packed_bytes() == sum(m.packed_bytes() for part in whole for layer in part
                                    for m in layer)
    for l in range(len(whole[0])):
        gu, dn = qe.layer(l)
        for a, b in zip(gu + dn, whole[0][l] + whole[1][l], strict=True):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
            assert a.scales.dtype == b.scales.dtype and (a.bits, a.group, a.shape) == \
                (b.bits, b.group, b.shape)
    assert qe.meta["spec"]["method"] == "gptqmodel" and qe.meta["imported_from"] == str(folder)
    # experts moved into the host store: the fused parameters empty (the whole import found
    # no experts there)
    hosted = _tiny("tiny_deepseek")
    HostExpertStore.from_model(hosted.model, pin=False)
    there = import_gptq(folder, hosted.model, dtype)
    assert there.packed_bytes() == qe.packed_bytes()
    for l in range(len(whole[0])):
        gu, dn = there.layer(l)
        assert all(torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
                   for a, b in zip(gu + dn, whole[0][l] + whole[1][l], strict=True))
    write_gptq_checkpoint(lm, tmp_path / "asym", zero=9)
    with pytest.raises(UserError, match="asymmetric GPTQ"):
        import_gptq(tmp_path / "asym", lm.model)


def test_a_shipped_gptq_draft_is_imported_not_quantized_again(tiny_models, tmp_path, monkeypatch):
    """`quant.path`: a GPTQ INT4 checkpoint in the GPTQModel / AutoGPTQ layout (per-expert
    qweight / qzeros / scales / g_idx, the settings in config.json's quantization_config) is
    the draft as it is: its weights dequantize to (q - 8) x scale, nothing is calibrated, and
    Specter with it is lossless."""
    from specter.compose import job_of
    from specter.recipes import build_engine
    from specter.budget import ResolvedBudget
    from specter.config import RunConfig
    from specter.models.introspect import experts_modules
    from test_offload import A100

    lm = tiny_models("tiny_deepseek")
    folder = tmp_path / "gptq"
    truth = write_gptq_checkpoint(lm, folder)

    called = []
    monkeypatch.setattr(calibrate, "quantize_experts", lambda *a, **k: called.append(1))
    run = RunConfig.from_dict({
        "model": {"name": "tiny_deepseek", "source": "project"}, "budget": {"name": "high"},
        "system": {"name": "specter"}, "dataset": {"name": "gsm8k"}, "hardware": A100,
        "workload": {}, "quant": {"path": str(folder), "backend": "reference"},
        "spec": {"k": 3}, "progress": False})
    from specter.quant.build import int4_experts_for

    draft = int4_experts_for(job_of(run, lm, ResolvedBudget("high", 8, "test"), torch.device("cpu")))
    assert not called and draft.reused and draft.path == folder
    for l, (layer, mod) in enumerate(experts_modules(lm.model)):
        for e in (0, 5):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            want = torch.cat([truth[f"{p}.gate_proj"], truth[f"{p}.up_proj"]])
            assert torch.allclose(draft.experts.gate_up[l][e].dequantize(torch.float32), want)
            assert torch.allclose(draft.experts.down[l][e].dequantize(torch.float32),
                                  truth[f"{p}.down_proj"])
    from conftest import PROMPTS
    from specter.decoding.engines import resident_engine

    ids = lm.tokenizer(PROMPTS[0])["input_ids"][:12]
    ref = resident_engine(lm.model, torch.device("cpu")).generate(ids, 16).tokens
    fresh = _tiny("tiny_deepseek")  # offloading mutates a model: a fresh one
    engine = build_engine(job_of(run, fresh, ResolvedBudget("high", 8, "test"),
                                       torch.device("cpu")))
    assert not called
    assert engine.generate(ids, 16).tokens == ref


def test_cuda_graphs_are_a_switch_on_where_they_work():
    """quant.graphs: auto replays draft layers only on CUDA with a fixed-shape backend; `on`
    where that cannot work is one sentence; off is off."""
    from types import SimpleNamespace as NS

    from specter.quant.step_form import draft_step_form

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def resolve_graphs(name, backend, device):  # a sampled job: the step stays eager
        job = NS(draft=NS(compile="auto", quant=NS(graphs=name)), rows=1, temperature=0.7,
                 device=device)
        form = draft_step_form(job, backend)
        return form.layer_graphs, form.graphs_why

    assert resolve_graphs("auto", "gather_int4", cuda)[0] is True
    assert resolve_graphs("auto", "triton", cuda)[0] is True
    assert resolve_graphs("auto", "cuda_int4", cuda) == (False, "auto: cuda_int4 issues kernels per routed expert")
    assert resolve_graphs("auto", "gather_int4", cpu)[0] is False
    assert resolve_graphs("off", "gather_int4", cuda)[0] is False
    with pytest.raises(UserError, match="needs a fixed-shape draft backend"):
        resolve_graphs("on", "cuda_int4", cuda)
    with pytest.raises(UserError, match="replays CUDA graphs"):
        resolve_graphs("on", "gather_int4", cpu)
    with pytest.raises(UserError, match="unknown quant.graphs"):
        resolve_graphs("sometimes", "gather_int4", cuda)
    with pytest.raises(UserError, match="fixed-shape backend"):
        kernels.make_experts("cpu_int4", *_random_layer(), _act, graphs=True)
