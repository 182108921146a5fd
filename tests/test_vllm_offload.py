"""system=vllm_offload (baselines/vllm_offload.py): vLLM's cpu_offload_gb on the virtual clock.
Lossless (resident's greedy decoding), and it charges exactly the bytes its rule says: the
offloaded layers' fixed weights and the experts the tokens chose (or every offloaded byte)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from baselines.vllm_offload import OffloadedReads
from specter.clock.costmodel import ChargedSizes

BASE = ["model=tiny_deepseek", "workload.items=2", "workload.max_new_tokens=12",
        "workload.stop_on_eos=false", "hardware=a100_pcie4_ideal", "progress=false"]


def _run(tmp_path, name, *extra):
    from experiments import records, runner
    from specter.settings import run_config

    runner.run(run_config([*BASE, *extra, f"out_dir={tmp_path / name}"]), log=lambda *_: None)
    return records.load(tmp_path / name).sort_values("request_id")


def test_vllm_offload_is_lossless_and_pays_for_what_does_not_fit(tiny_models, tmp_path):
    tiny_models("tiny_deepseek")
    resident = _run(tmp_path, "resident", "system=resident")
    offl = _run(tmp_path, "vllm", "system=vllm_offload", "budget=gb", "budget.gb=20")
    every = _run(tmp_path, "all", "system=vllm_offload", "budget=gb", "budget.gb=20",
                 "system.reads=all")
    fits = _run(tmp_path, "fits", "system=vllm_offload", "budget=gb", "budget.gb=40")
    for df in (offl, every, fits):
        assert df["output_tokens"].map(tuple).tolist() == resident["output_tokens"].map(tuple).tolist()
    assert (fits["vllm_read_bytes"] == 0).all() and (fits["budget_offload_bytes"] == 0).all()
    assert fits["tpot_ms"].tolist() == pytest.approx(resident["tpot_ms"].tolist())
    assert (offl["vllm_read_bytes"] > 0).all() and (offl["tpot_ms"] > resident["tpot_ms"]).all()
    assert (every["vllm_read_bytes"] > offl["vllm_read_bytes"]).all()
    assert (offl["h2d_bytes"] == offl["vllm_read_bytes"]).all()  # charged on the shared link


def _sizes(**kw):
    base = dict(source="real:x", elem_bytes=2, attn_params=100, router_params=10, shared_params=40,
                dense_mlp_params=300, expert_params=50, lm_head_params=0, kv_elems_per_token=0,
                heads=1, head_dim=1, attn_multiplier=3.0, moe_multiplier=2.0,
                dense_multiplier=0.0, unmodelled_dense_layers=1)
    return ChargedSizes(**{**base, **kw})


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 2, 2))  # 4 experts
        self.down_proj = torch.nn.Parameter(torch.zeros(4, 2, 1))


class _Model(torch.nn.Module):
    """Two modelled MoE layers standing for four real MoE layers and one real dense one."""

    def __init__(self):
        super().__init__()
        layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = _Experts()
            layers.append(layer)
        self.model = torch.nn.Module()
        self.model.layers = layers


def test_the_offloaded_share_goes_to_the_first_layers_and_is_read_by_the_rule():
    sizes = _sizes()
    timing = SimpleNamespace(link=None, cost=SimpleNamespace(sizes=sizes))
    dense, fixed, expert = (100 + 300) * 2, (100 + 10 + 40) * 2, 50 * 2
    moe = fixed + 4 * expert  # 700 bytes; the real layers: dense 800, then 4 x 700
    total = dense + 4 * moe
    # 800 + 700 + half of the next: the dense layer, real MoE layer 0, half of real layer 1
    reads = OffloadedReads(_Model(), timing, share=(dense + 1.5 * moe) / total)
    assert reads.offloaded_bytes == dense + 1.5 * moe
    # modelled layer 0 stands for real MoE layers 0 and 1 (and carries the dense layer)
    assert reads.bytes_for(0, distinct=2) == dense + 1.5 * (fixed + 2 * expert)
    assert reads.bytes_for(1, distinct=2) == 0  # real layers 2 and 3 stay on the device
    every = OffloadedReads(_Model(), timing, share=1.0, reads="all")
    assert every.bytes_for(1, distinct=1) == 2 * moe
    assert OffloadedReads(_Model(), timing, share=0.0).bytes_for(0, 4) == 0
