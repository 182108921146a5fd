"""Host memory of preparing the INT4 self-draft, per MoE layer, and the runner's host check.

The draft is prepared as a run prepares it: the routed experts in the host store, the draft
quantized (RTN) and saved by `ensure_quantized`, then built layer by layer on the device by
`DraftMode` (`cpu_int4`). On the CPU the device is the host, so the process's resident memory
holds the draft's device copy too; that copy is the device's (budget.py counts it), and what
the host holds beyond it is the host-only extra the bound is about. A draft imported from a
GPTQ checkpoint (`quant.path`, gptq_import.py) is prepared and bounded the same way.

Measured in fresh processes (one's heap is not the other's) at DeepSeek-V2-Lite's expert width
(H 2048, I 1408) with few experts, at two depths: the slope per MoE layer is what a deeper
model adds. Issue 46 item 5: a run's host peak is at most 1.15x the routed experts plus the
rest, so the draft's host-only extra may grow by at most 0.15x one layer's experts a layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
H_LITE, I_LITE = 2048, 1408
EXPERTS = 8  # per layer: few, for time; the widths are the real model's
BOUND = 0.15  # of one layer's routed experts' bytes, host-only extra per MoE layer


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The process's resident memory sampled every 2 ms inside the block: its peak."""

    def __enter__(self):
        self.peak, self._stop = _rss(), False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _write_gptq(model, folder: Path) -> None:
    """A GPTQ INT4 checkpoint of `model`'s routed experts (random codes, symmetric, group 128,
    in the GPTQModel / AutoGPTQ layout), one safetensors file per MoE layer."""
    import torch
    from safetensors.torch import save_file

    from specter.models.introspect import experts_modules

    g = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    for layer, mod in experts_modules(model):
        n_exp, two_i, hidden = mod.gate_up_proj.shape
        tensors = {}
        for e in range(n_exp):
            for name, (out, inp) in (("gate_proj", (two_i // 2, hidden)),
                                     ("up_proj", (two_i // 2, hidden)),
                                     ("down_proj", (hidden, two_i // 2))):
                p = f"model.layers.{layer}.mlp.experts.{e}.{name}"
                tensors[f"{p}.qweight"] = torch.randint(-2**31, 2**31 - 1, (inp // 8, out),
                                                        generator=g, dtype=torch.int32)
                # every code's zero point 8, stored minus one ("gptq" v1): 0x77777777
                tensors[f"{p}.qzeros"] = torch.full((inp // 128, out // 8), 0x77777777,
                                                    dtype=torch.int32)
                tensors[f"{p}.scales"] = (torch.rand(inp // 128, out, generator=g) / 100).half()
                tensors[f"{p}.g_idx"] = (torch.arange(inp) // 128).to(torch.int32)
        save_file(tensors, str(folder / f"layer{layer}.safetensors"))
        del tensors
    (folder / "quantize_config.json").write_text(json.dumps(
        {"bits": 4, "group_size": 128, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq"}))


def _child(layers: int, experts: int, cache: str, source: str = "rtn") -> dict:
    """Build a DeepSeek-V2 of `layers` MoE layers at real expert width, experts in the host
    store, then prepare its draft, quantized (`rtn`) or imported from a GPTQ checkpoint
    written to `cache` (`gptq`, `quant.path`); what the process held at each phase, in
    bytes ("quant": the quantization or the import)."""
    import ctypes

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from specter.decoding.draft_mode import DraftMode
    from specter.offload.store import HostExpertStore
    from specter.quant import calibrate
    from specter.quant.gptq_import import import_gptq

    torch.set_num_threads(1)
    cfg = DeepseekV2Config(
        vocab_size=256, hidden_size=H_LITE, intermediate_size=64, moe_intermediate_size=I_LITE,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, max_position_embeddings=256, topk_method="greedy",
        n_group=None, topk_group=None)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(cfg)
    model = model.to(torch.bfloat16).to_empty(device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if source == "gptq":  # from the fused parameters, before they move to the store
        _write_gptq(model, Path(cache))
    store = HostExpertStore.from_model(model, pin=False)
    expert_bytes = store.layout.nbytes * experts * layers
    try:  # what construction freed goes back first: the base is what the process holds
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    base = _rss()
    cpu = torch.device("cpu")
    spec = calibrate.QuantSpec(method="rtn", bits=4, group=128)
    with torch.no_grad(), _Peak() as quant:
        if source == "gptq":
            qe = import_gptq(Path(cache), model)
        else:
            qe, _, reused = calibrate.ensure_quantized(model, None, spec, Path(cache), cpu)
            assert not reused
    after_quant = _rss()
    with torch.no_grad(), _Peak() as build:
        sw = DraftMode(model, qe, "cpu_int4", cpu)
    return {"layers": layers, "experts": experts, "expert_bytes": expert_bytes, "base": base,
            "quant_peak": quant.peak, "after_quant": after_quant, "build_peak": build.peak,
            "after_build": _rss(), "device_bytes": sw.draft_bytes}


def _measure(layers: int, cache: Path, source: str = "rtn") -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, __file__, str(layers), str(EXPERTS), str(cache), source],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("source", ["rtn", "gptq"])
def test_draft_preparation_host_growth_per_layer_is_bounded(tmp_path, source):
    """Per MoE layer more, the host-only bytes the draft's preparation adds (its peak less
    the draft's device copy) grow by at most 0.15x one layer's routed experts, and the
    quantization alone leaves nothing behind on the host: the draft is built layer by layer,
    with no copy of every layer held at once and no freed memory kept by the allocator.
    `gptq`: the draft imported from a GPTQ checkpoint (`quant.path`), whose import read and
    kept every layer at once before it read them one at a time."""
    one, three = _measure(1, tmp_path / "c1", source), _measure(3, tmp_path / "c3", source)
    assert three["device_bytes"] == 3 * one["device_bytes"] > 0  # every layer's experts built
    layer_bytes = one["expert_bytes"]  # one MoE layer's routed experts
    allowed = BOUND * layer_bytes

    def host_only(r, peak):  # what the phase held at its peak, less the device's copy
        return r[peak] - r["base"] - (r["device_bytes"] if peak == "build_peak" else 0)

    for peak in ("quant_peak", "build_peak"):
        slope = (host_only(three, peak) - host_only(one, peak)) / 2
        assert slope <= allowed, (
            f"{peak}: {slope / 2**20:.1f} MiB more host memory a MoE layer, at most "
            f"{allowed / 2**20:.1f} (0.15 x {layer_bytes / 2**20:.0f} MiB of experts); "
            f"1 layer {host_only(one, peak) / 2**20:.0f} MiB, 3 layers "
            f"{host_only(three, peak) / 2**20:.0f} MiB")
    kept = (three["after_quant"] - three["base"]) - (one["after_quant"] - one["base"])
    assert kept / 2 <= allowed, f"the quantization keeps {kept / 2 / 2**20:.0f} MiB a layer"


def test_a_saved_draft_is_read_one_layer_at_a_time(tiny_models, tmp_path):
    """What `ensure_quantized` returns holds no layer: each is read from its file when a
    backend asks for it, and gate_up[l] then down[l] read that file once and keep nothing;
    the same codes as the quantization kept in memory."""
    import torch

    from specter.quant import calibrate

    lm = tiny_models("tiny_deepseek")
    cpu = torch.device("cpu")
    spec = calibrate.QuantSpec(method="rtn", bits=4, group=32)
    kept = calibrate.quantize_experts(lm.model, spec, None, cpu)
    qe, path, _ = calibrate.ensure_quantized(lm.model, None, spec, tmp_path, cpu)
    assert isinstance(qe.gate_up, calibrate.SavedLayers)
    reader = qe.gate_up.reader
    reads = []
    real = reader.read
    reader.read = lambda l: reads.append(l) or real(l)
    for l in range(len(qe.gate_up)):
        gu, dn = qe.gate_up[l], qe.down[l]
        assert reader._held is None  # both taken: nothing held
        for a, b in zip(gu + dn, kept.gate_up[l] + kept.down[l]):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert reads == list(range(len(qe.gate_up)))
    assert qe.packed_bytes() == kept.packed_bytes() and qe.groups() == kept.groups()
    assert not list(path.glob("layer*.json"))  # the resume metadata went with publishing


class _CountedOpen:
    """`safetensors.safe_open` that notes the name of every tensor read through it."""

    def __init__(self, real, reads: list):
        self.real, self.reads = real, reads

    def __call__(self, *args, **kwargs):
        return _CountedHandle(self.real(*args, **kwargs), self.reads)


class _CountedHandle:
    def __init__(self, handle, reads: list):
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def get_tensor(self, name):
        self.reads.append(name)
        return self.handle.get_tensor(name)

    def get_tensors(self):
        self.reads.extend(self.handle.keys())
        return self.handle.get_tensors()

    def __getattr__(self, name):  # keys, get_slice, metadata: headers only
        return getattr(self.handle, name)


def test_a_gptq_checkpoint_is_imported_one_layer_at_a_time(tiny_models, tmp_path, monkeypatch):
    """`quant.path`: `import_gptq` reads the checkpoint's headers (and one linear's zero points
    and group index, to refuse a checkpoint it cannot import at once), no codes or scales; a
    backend asking for MoE layer l (gate_up[l] then down[l]) reads layer l's tensors once
    each, nothing of another layer, and nothing is held after: the host holds one layer of the
    imported draft at a time, as for one quantized here."""
    import safetensors
    import safetensors.torch

    from specter.models.introspect import experts_modules
    from specter.quant import calibrate
    from specter.quant.gptq_import import import_gptq
    from test_quant import write_gptq_checkpoint

    lm = tiny_models("tiny_deepseek")
    folder = tmp_path / "gptq"
    write_gptq_checkpoint(lm, folder, shards=2)
    reads: list[str] = []
    for module in (safetensors, safetensors.torch):
        monkeypatch.setattr(module, "safe_open", _CountedOpen(safetensors.safe_open, reads))
    qe = import_gptq(folder, lm.model)
    assert not [k for k in reads if k.endswith((".qweight", ".scales"))], reads[:4]
    assert len(reads) <= 2  # one linear's qzeros and g_idx
    assert isinstance(qe.gate_up, calibrate.SavedLayers)
    reader = qe.gate_up.reader
    for l, (layer, mod) in enumerate(experts_modules(lm.model)):
        reads.clear()
        gu, dn = qe.gate_up[l], qe.down[l]
        assert reader._held is None  # both taken: nothing held
        assert len(gu) == len(dn) == mod.gate_up_proj.shape[0]
        assert {k.split(".")[2] for k in reads} == {str(layer)}  # this layer's tensors only
        assert len(reads) == len(set(reads)) == 3 * 4 * len(gu)  # each once


@pytest.mark.parametrize("n,k", [(2 * I_LITE, H_LITE), (H_LITE, I_LITE), (304, 96), (48, 128)])
def test_cpu_int4_packing_in_row_blocks_is_the_whole_matrix_packing(n, k):
    """`cpu_int4` packs `PACK_ROWS` rows at a time: the bytes torch's packing gives the whole
    matrix at once (it rearranges codes within 64-row blocks only), tails included."""
    import torch

    from specter.quant import kernels
    from specter.quant.formats import rtn_quantize

    g = torch.Generator().manual_seed(0)
    qm = rtn_quantize(torch.randn(n, k, generator=g).to(torch.bfloat16), 4, 32)
    whole = torch._convert_weight_to_int4pack_for_cpu(qm.unpacked().to(torch.int32), 1)
    assert kernels.PACK_ROWS % 64 == 0
    assert torch.equal(kernels._int4pack_cpu(qm, torch.float32)[0], whole)


# -- the runner's preflight: what each system will hold in host memory -----------------------
def _cfg(system: str, *over: str):
    from hydra import compose, initialize_config_dir

    from specter.settings import CONF, checked_overrides, to_run_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=checked_overrides(
            [f"system={system}", "model=tiny_deepseek", "quant.method=rtn", "progress=false",
             "hardware=a100_pcie4_hf", *over])))


def _meminfo(path: Path, kib: int) -> Path:
    path.write_text(f"MemTotal:       {4 * kib} kB\nMemFree:        {kib} kB\n"
                    f"MemAvailable:   {kib} kB\n")
    return path


def test_the_preflight_counts_what_each_system_holds_on_the_host(tiny_models, tmp_path,
                                                                 monkeypatch):
    """Before anything loads, the preflight counts each system's host bytes (on the CPU the
    device's weights are the host's too) against MemAvailable: enough passes and says what
    it counted; too little is one sentence naming each item."""
    import torch

    from specter import compose
    from specter.errors import UserError

    lm = tiny_models("tiny_deepseek")
    n_experts, cpu = lm.spec.num_experts, torch.device("cpu")
    # a random store an earlier test of this process left held would count as available
    monkeypatch.setattr("specter.placement.loader.held_random_store_bytes", lambda: 0)
    monkeypatch.setattr(compose, "MEMINFO", _meminfo(tmp_path / "plenty", 64 * 2**20))
    held = {name: dict(compose.check_host_holds(_cfg(name), lm.checkpoint, cpu, n_experts))
            for name in ("lru", "specter", "resident")}
    experts = sum(t.numel() * t.element_size() for m in lm.model.modules()
                  if hasattr(m, "gate_up_proj") for t in (m.gate_up_proj, m.down_proj))
    assert held["resident"]["the routed experts"] == experts
    assert held["lru"]["the routed experts in the host store"] >= experts
    assert set(held["specter"]) == set(held["lru"]) | {"one MoE layer of the INT4 draft",
                                                       "the INT4 draft backend's copy"}
    layer, whole = (held["specter"][k] for k in ("one MoE layer of the INT4 draft",
                                                 "the INT4 draft backend's copy"))
    assert whole == lm.spec.num_moe_layers * layer  # one layer on the host, not the draft

    need = sum(held["specter"].values())
    monkeypatch.setattr(compose, "MEMINFO", _meminfo(tmp_path / "short", need // 1024 - 64))
    compose.check_host_holds(_cfg("lru"), lm.checkpoint, cpu, n_experts)  # lru's still fits
    with pytest.raises(UserError) as err:
        compose.preflight(_cfg("specter"), lm.checkpoint, cpu, n_experts)
    msg = str(err.value)
    assert msg.startswith("system=specter with model=tiny_deepseek needs ") and msg.count(". ") == 0
    assert "(the routed experts in the host store " in msg and "one MoE layer of the INT4 " \
        "draft" in msg and "available (MemAvailable): free memory" in msg, msg


def test_a_run_that_does_not_fit_the_host_exits_with_one_sentence(tiny_models, tmp_path):
    """run.py with too little MemAvailable: exit status 2 and one line, before loading."""
    tiny_models("tiny_deepseek")  # built into the shared cache
    fake = _meminfo(tmp_path / "meminfo", 1024)
    code = ("import sys; from pathlib import Path; from specter import compose; "
            f"compose.MEMINFO = Path({str(fake)!r}); import run; run.main()")
    res = subprocess.run([sys.executable, "-c", code, "system=specter", "model=tiny_deepseek",
                          "quant.method=rtn", "progress=false", f"out_dir={tmp_path / 'out'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "of host memory (" in lines[0] and \
        "this host has 1.0 MiB available (MemAvailable)" in lines[0], res.stderr[-2000:]
    assert not (tmp_path / "out" / "records").exists()


if __name__ == "__main__":
    print(json.dumps(_child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])))
