"""`system=host_experts` / `host_experts_s` (every routed expert computed on the host, the
design of llama.cpp's CPU experts, kTransformers and Fiddler): lossless on every tiny
architecture, no expert ever copied and no slot held under any budget, each MoE layer one host
job charged as the cost model says (checked by hand arithmetic), bandwidth-bound at batch 1
and FLOP-bound as tokens grow, and the CPU's own clock runs it."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from specter.compose import job_of
from specter.recipes import build_engine, footprint
from specter import budget as budget_mod
from specter.config import RunConfig, SystemConfig
from specter.models import archs
from specter.placement.loader import load_model
from test_batch import A100, CPU, prompts


def engine_for(name: str, system: str, hardware=A100, budget: str = "low", **spec):
    cfg = RunConfig.from_dict({
        "model": {"name": name, "source": "project", "dtype": "float32",
                  "stands_for": archs.STANDS_FOR[archs.parse_name(name)[1]]},
        "budget": {"name": budget}, "system": {"name": system}, "dataset": {"name": "gsm8k"},
        "hardware": hardware, "workload": {}, "spec": {"k": 4, **spec}, "progress": False})
    lm = load_model(cfg.model, CPU, progress=False)
    b = budget_mod.resolve(cfg.budget, cfg.model, None, lm.spec.num_experts, lm.spec.top_k,
                           footprint(cfg.system), kv_tokens=64)
    return build_engine(job_of(cfg, lm, b, CPU)), lm, b


@pytest.mark.parametrize("name", TINY)
def test_every_expert_on_the_host_is_lossless_and_copies_nothing(name):
    resident, lm, _ = engine_for(name, "resident")
    batch = prompts(lm.tokenizer, 3)
    ref = [g.tokens for g in resident.generate_batch(batch, 16)]
    for system in ("host_experts", "host_experts_s"):
        engine, _, b = engine_for(name, system)
        assert b.slots > 0 and engine.runtime.cache.slots == 0 and engine.runtime.host_all
        engine.reset()
        gens = engine.generate_batch(batch, 16)
        assert [g.tokens for g in gens] == ref, system
        stats = gens[0].stats
        assert stats["h2d_bytes"] == 0 and stats["demand_hits"] == stats["demand_misses"] == 0
        assert stats["host_experts"] > 0 and stats["host_busy_ms"] > 0


def test_a_layer_is_one_host_job_charged_by_hand_arithmetic():
    """One MoE layer of host_experts over 2 tokens: one host job of every needed expert's
    host time over its tokens (the host's memory bandwidth at this size) plus one round trip
    of the 2 tokens' activations; the device waits for it; the copy engine moves nothing."""
    engine, lm, _ = engine_for("tiny_deepseek", "host_experts")
    rt = engine.runtime
    hw, s, k, E = rt.cost.hw, rt.cost.sizes, lm.spec.top_k, lm.spec.num_experts
    engine.reset()
    hidden = torch.randn(2, lm.model.config.hidden_size)
    idx = torch.stack([torch.arange(k), torch.arange(1, k + 1) % E])  # experts 0..k: 2 tokens
    weights = torch.full((2, k), 1.0 / k)
    counts = [1] + [2] * (k - 1) + [1]  # expert 0 and expert k once, the others twice
    expert = [max(2.0 * n * s.expert_params / hw.host_matrix_flops,
                  s.expert_bytes / hw.host_mem_bandwidth_Bps) + hw.expert_overhead_s
              for n in counts]
    trip = 2 * (2 * s.hidden * s.elem_bytes / hw.h2d_bandwidth_Bps + hw.h2d_latency_s)
    expect = (sum(expert) + trip) * s.moe_multiplier
    rt.link.reset_stats()
    t0 = rt.link.now()
    rt.experts_forward(0, rt.modules[0], hidden, idx, weights)
    assert rt.link.host_busy_s == pytest.approx(expect)
    steps = rt.cost.router_s(2) + rt.cost.offload_layer_s(2)
    assert rt.link.now() - t0 == pytest.approx(steps + expect)
    assert rt.link.stats().h2d_bytes == 0
    assert rt.stats.host_experts == k + 1


def test_bandwidth_bound_at_one_token_flop_bound_as_tokens_grow():
    engine, _, _ = engine_for("tiny_qwen", "host_experts")
    cost, hw, s = engine.runtime.cost, engine.runtime.cost.hw, engine.runtime.cost.sizes
    read = s.expert_bytes / hw.host_mem_bandwidth_Bps
    flops = lambda n: 2.0 * n * s.expert_params / hw.host_matrix_flops  # noqa: E731
    assert flops(1) < read
    assert cost.host_expert_s(1) == pytest.approx((read + hw.expert_overhead_s) * s.moe_multiplier)
    many = 100 * int(read / flops(1))
    assert cost.host_expert_s(many) == pytest.approx((flops(many) + hw.expert_overhead_s)
                                                     * s.moe_multiplier)


def test_its_time_follows_the_host_and_not_the_budget_or_the_link_rate():
    """Halving the host's bandwidth slows it; the budget and the link's H2D rate for weights do
    not matter (no expert is copied); the link's rate still carries the activations."""
    def tpot(budget="low", **hw):
        engine, lm, _ = engine_for("tiny_deepseek", "host_experts", dict(A100, **hw), budget)
        engine.reset()
        g = engine.generate_batch(prompts(lm.tokenizer, 1), 8)[0]
        return g.commit_times_s[-1] - g.commit_times_s[0]  # the decode steps after the first

    base = tpot()
    assert tpot("high") == base
    assert tpot(host_mem_bandwidth_Bps=A100["host_mem_bandwidth_Bps"] / 2) > base
    assert tpot(h2d_bandwidth_Bps=A100["h2d_bandwidth_Bps"] / 2) > base  # activations only
    assert tpot(h2d_bandwidth_Bps=A100["h2d_bandwidth_Bps"] / 2) < base * 1.05


def test_the_cpu_clock_runs_it_and_the_budget_holds_no_slots():
    """hardware=cpu (the CPU's own clock): nothing is copied, so it runs at any budget; the
    byte accounting keeps no expert slot."""
    cpu = {"name": "cpu", "device": "cpu", "clock": "wall"}
    engine, lm, b = engine_for("tiny_qwen", "host_experts", cpu, "high")
    assert budget_mod.held_slots(b, footprint(SystemConfig(name="host_experts"))) == 0
    assert engine.runtime.cache.slots == 0 and "host" in b.rule and "unused" in b.note
    resident, _, _ = engine_for("tiny_qwen", "resident", cpu)
    batch = prompts(lm.tokenizer, 2)
    ref = [g.tokens for g in resident.generate_batch(batch, 8)]
    engine.reset()
    assert [g.tokens for g in engine.generate_batch(batch, 8)] == ref
    engine.runtime.link.close()


def test_the_crossover_table_finds_the_fastest_and_the_crossing():
    """experiments/plots/crossover.py on a hand-made table: host_experts falls from 40 to 10
    ms as the host's bandwidth goes 25 -> 60 GB/s, Specter is 20 ms throughout: 20 ms above
    it, then 10 below, so they meet at 25 + (60 - 25) * 20 / 30 = 48.33 GB/s."""
    import pandas as pd

    from experiments.plots.crossover import answer, crossing, named_hosts

    case = dict(model="m", budget="high", hardware="a100_pcie4_ideal", engine="ideal",
                clock="virtual", charged="own")
    rows = [dict(case, system="host_experts", host_GBps=bw, tpot_ms=tp)
            for bw, tp in ((25.0, 40.0), (60.0, 10.0), (300.0, 5.0))]
    rows.append(dict(case, system="specter", host_GBps=300.0, tpot_ms=20.0))
    t = pd.DataFrame(rows)
    assert crossing(t, "host_experts", "specter") == pytest.approx(25 + 35 * 20 / 30)
    hosts = named_hosts()
    assert hosts == {"epyc7742_2s": 300.0, "desktop_ddr5_2ch": 60.0}
    a = answer(t).iloc[0]
    assert a["fastest at epyc7742_2s (300 GB/s)"] == "host_experts"
    assert a["host_experts = specter at GB/s"] == pytest.approx(25 + 35 * 20 / 30)
    t.loc[t["system"] == "host_experts", "tpot_ms"] += 100  # never below Specter: no crossing
    assert crossing(t, "host_experts", "specter") != crossing(t, "host_experts", "specter")
    assert answer(t).iloc[0]["fastest at desktop_ddr5_2ch (60 GB/s)"] == "specter"


def test_figures_name_the_host_the_host_systems_ran_with():
    import pandas as pd

    from experiments.plots.base import clock_note

    df = pd.DataFrame({"system": ["specter", "host_experts"], "clock": "virtual",
                       "hardware": "a100_pcie4_ideal", "cfg.hardware.host": "epyc7742_2s",
                       "cfg.hardware.host_mem_bandwidth_Bps": 3e11})
    assert "host epyc7742_2s (300 GB/s)" in clock_note(df)
    assert "host" not in clock_note(df[df["system"] == "specter"])
