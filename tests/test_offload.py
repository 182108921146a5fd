"""Offloaded experts: lossless against `resident` on every tiny architecture and budget, the
cache's invariants, and the cost model against hand arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import PROMPTS, TINY
from specter.compose import job_of
from specter.recipes import build_engine
from specter.budget import resolve_slots
from specter.config import RunConfig
from specter.models import archs
from specter.placement.loader import load_model
from specter.models.real_configs import REAL_CONFIGS
from specter.clock.costmodel import CostModel, HardwareProfile, real_charged_sizes

A100 = {"name": "a100_pcie4_ideal", "device": "cpu", "clock": "virtual", "charge": "own",
        "matrix_flops": 312e12, "mem_bandwidth_Bps": 1.555e12, "launch_overhead_s": 5e-6,
        "h2d_bandwidth_Bps": 31.5e9, "h2d_latency_s": 10e-6}


def make_engine(name: str, system: str | dict, slots: int | None, hardware=None, budget="high",
                spec: dict | None = None, staging: int = 0, offload: dict | None = None):
    """`system`: a name, or a dict with `name` and knobs; `spec`: e.g. {"k": 4}; `staging`:
    staging buffers (budget.staging)."""
    cfg = RunConfig.from_dict({
        "model": {"name": name, "source": "project",
                  "stands_for": archs.STANDS_FOR[archs.parse_name(name)[1]]}, "budget": {"name": budget, "slots": slots},
        "system": system if isinstance(system, dict) else {"name": system},
        "dataset": {"name": "gsm8k"}, "hardware": hardware or A100, "workload": {},
        "spec": spec or {}, "offload": offload or {}, "progress": False})
    loaded = load_model(cfg.model, torch.device("cpu"), progress=False)  # fresh: offloading mutates it
    budget_r = resolve_slots(cfg.budget, cfg.model, loaded.spec.num_experts, loaded.spec.top_k)
    budget_r = dataclasses.replace(budget_r, staging=staging)
    return build_engine(job_of(cfg, loaded, budget_r, torch.device("cpu"))), loaded


def decode_all(engine, tokenizer, n=20):
    outs = []
    for text in PROMPTS:
        engine.reset()
        outs.append(engine.generate(tokenizer(text)["input_ids"][:16], n))
    return outs


@pytest.mark.parametrize("name", TINY)
def test_lru_is_lossless_at_every_budget(name):
    resident, loaded = make_engine(name, "resident", None)
    ref = [g.tokens for g in decode_all(resident, loaded.tokenizer)]
    e, k = loaded.spec.num_experts, loaded.spec.top_k
    for slots in sorted({k, (k + e) // 2, e}):
        lru, _ = make_engine(name, "lru", slots)
        gens = decode_all(lru, loaded.tokenizer)
        assert [g.tokens for g in gens] == ref, f"{name} at {slots} slots"
        misses = sum(g.stats["demand_misses"] for g in gens)
        if slots == e:
            assert misses == 0
        if slots == k:
            assert misses > 0 and all(g.stats["h2d_bytes"] > 0 for g in gens)


def test_offloaded_logits_equal_resident_logits():
    resident, loaded = make_engine("tiny_qwen", "resident", None)
    lru, _ = make_engine("tiny_qwen", "lru", 4)
    lru.reset()
    ids = torch.tensor([loaded.tokenizer(PROMPTS[0])["input_ids"][:16]])
    with torch.no_grad():
        a = resident.model(input_ids=ids).logits
        b = lru.model(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_virtual_clock_is_deterministic_and_offloading_costs_time():
    slow = dict(A100, h2d_bandwidth_Bps=0.2e9)  # a slow link: the tiny experts' misses show
    # one GEMM per expert (offload.grouped=false): the compute charged is the same whatever
    # the link (the rounds of the grouped kernel follow what has landed)
    loop = {"grouped": False}
    lru_a, loaded = make_engine("tiny_deepseek", "lru", 6, hardware=slow, offload=loop)
    lru_b, _ = make_engine("tiny_deepseek", "lru", 6, hardware=slow, offload=loop)
    res, _ = make_engine("tiny_deepseek", "resident", None, hardware=slow)
    fast, _ = make_engine("tiny_deepseek", "lru", 6, offload=loop)
    ga, gb = decode_all(lru_a, loaded.tokenizer), decode_all(lru_b, loaded.tokenizer)
    gr, gf = decode_all(res, loaded.tokenizer), decode_all(fast, loaded.tokenizer)
    assert [g.commit_times_s for g in ga] == [g.commit_times_s for g in gb]
    span = lambda g: g.commit_times_s[-1] - g.start_time_s  # noqa: E731
    for a, r, f in zip(ga, gr, gf):
        assert span(a) > span(r) and a.stats["exposed_wait_ms"] > 0
        assert 0 < a.stats["hit_rate"] < 1 and a.stats["h2d_bytes"] > 0
        # Same routing, same compute charges: only the link differs, so only the waits do.
        assert f.tokens == a.tokens and f.stats["demand_misses"] == a.stats["demand_misses"]
        assert span(a) - span(f) == pytest.approx(
            (a.stats["exposed_wait_ms"] - f.stats["exposed_wait_ms"]) / 1e3, rel=1e-6, abs=1e-12)


def test_real_sizes_charged_expose_transfer_time():
    # DeepSeek-V2-Lite's 17.3 MB experts (0.56 ms each on PCIe 4.0) cannot hide behind
    # 26 us expert GEMVs: at top-k slots, misses stall the compute stream.
    real = dict(A100, charge="real")
    lru, loaded = make_engine("tiny_deepseek", "lru", 6, hardware=real)
    res, _ = make_engine("tiny_deepseek", "resident", None, hardware=real)
    for g, r in zip(decode_all(lru, loaded.tokenizer), decode_all(res, loaded.tokenizer)):
        assert g.tokens == r.tokens
        assert g.stats["exposed_wait_ms"] > 0 and 0 <= g.stats["h2d_hidden_frac"] < 1
        assert g.stats["charged.source"] == "real:deepseek-ai/DeepSeek-V2-Lite"
        tpot = lambda x: (x.commit_times_s[-1] - x.commit_times_s[0]) / (len(x.tokens) - 1)  # noqa: E731
        assert tpot(g) > tpot(r)


def test_mo_sm_is_lossless_and_prefetches():
    res, loaded = make_engine("tiny_qwen", "resident", None)
    mo, _ = make_engine("tiny_qwen", "mo_sm", 8)
    ref = [g.tokens for g in decode_all(res, loaded.tokenizer)]
    gens = decode_all(mo, loaded.tokenizer)
    assert [g.tokens for g in gens] == ref
    assert sum(g.stats["prefetches"] for g in gens) > 0


def test_cache_never_evicts_needed_experts_and_counts_hits():
    lru, loaded = make_engine("tiny_deepseek", "lru", 6)
    lru.reset()
    cache = lru.runtime.cache
    assert all(cache.resident_set(l) == set(range(6)) for l in range(len(cache.layers)))
    cache.protect(0, {0, 1, 2, 3, 4, 5})
    assert cache.load(0, 10) is None  # every slot protected: refuse rather than evict
    cache.unprotect_all()
    t = cache.load(0, 10)
    assert t is not None and cache.resident(0, 10) and not cache.resident(0, 0)  # LRU victim
    cache.wait(0, 10)
    gate_up, down = cache.weights(0, 10)
    store_gu, store_dn = cache.layout.views(cache.store.expert(0, 10))
    assert torch.equal(gate_up, store_gu) and torch.equal(down, store_dn)


def test_cost_model_deepseek_expert_on_a100_matches_hand_arithmetic(capsys):
    hw = HardwareProfile("a100_pcie4_ideal", 312e12, 1.555e12, 5e-6, 31.5e9, 10e-6)
    sizes = real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(27, 26, 1))
    cost = CostModel(hw, sizes)
    # One DeepSeek-V2-Lite expert: gate, up, down, each 2048 x 1408, FP16.
    params = 3 * 2048 * 1408
    assert sizes.expert_params == params and sizes.expert_bytes == 2 * params == 17_301_504
    assert (sizes.attn_multiplier, sizes.moe_multiplier, sizes.dense_multiplier) == (1, 1, 1)
    transfer = 17_301_504 / 31.5e9 + 10e-6  # 0.5593 ms
    gemv = max(2 * params / 312e12, 2 * params / 1.555e12) + 3 * 5e-6  # memory-bound: 0.0261 ms
    assert cost.transfer_s(cost.expert_transfer_bytes()) == pytest.approx(transfer, rel=1e-12)
    assert cost.expert_s(1) == pytest.approx(gemv, rel=1e-12)
    print(f"DeepSeek-V2-Lite expert on a100_pcie4_ideal: transfer {transfer * 1e3:.4f} ms, "
          f"GEMV {gemv * 1e3:.4f} ms, ratio {transfer / gemv:.1f}x")
    assert "transfer 0.5593 ms" in capsys.readouterr().out
    # The INT4 draft: all of a layer's routed experts in one fused kernel (three launches),
    # 4-bit codes plus a 2-byte scale per group of 128 read for each routed expert.
    int4 = params / 2 + params / 128 * 2
    fused = max(2 * params * (1 + 2 + 3) / 312e12, 3 * int4 / 1.555e12) + 3 * 5e-6
    assert cost.draft_experts_s([1, 2, 3]) == pytest.approx(fused, rel=1e-12)
    # The host-computed draft (specmoe) needs the host profile.
    with pytest.raises(ValueError, match="no host profile"):
        cost.host_expert_s(1)
    host = CostModel(HardwareProfile("a100_pcie4_ideal", 312e12, 1.555e12, 5e-6, 31.5e9, 10e-6,
                                     host_matrix_flops=2e12, host_mem_bandwidth_Bps=1e11), sizes)
    assert host.host_expert_s(1) == pytest.approx(2 * params / 1e11, rel=1e-12)  # 0.173 ms


def test_offloading_on_a_plain_cpu_clock_is_refused_unless_every_expert_is_resident():
    from specter.errors import UserError

    cpu = {"name": "cpu", "device": "cpu", "clock": "wall"}
    with pytest.raises(UserError, match="needs a modelled link"):
        make_engine("tiny_phi", "lru", 2, hardware=cpu)
    # every expert resident (budget=full): nothing is copied while decoding, the CPU's own
    # clock times the compute, and the output is still the target's
    engine, loaded = make_engine("tiny_phi", "lru", None, hardware=cpu, budget="full")
    assert engine.runtime.cache.slots == loaded.spec.num_experts
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"][:16]
    engine.reset()
    gen = engine.generate(ids, 8)
    assert engine.runtime.stats.as_record()["hit_rate"] == 1.0 and gen.tokens


def test_real_sizes_scale_each_role_by_its_own_layer_count():
    """A 4-layer model (1 dense, 3 MoE) standing for DeepSeek-V2-Lite (27 = 1 dense + 26 MoE):
    attention x 27/4, MoE block x 26/3, the dense MLP x 1/1; one decode step then charges
    exactly the real model's per-token sum."""
    hw = HardwareProfile("a100_pcie4_ideal", 312e12, 1.555e12, 5e-6, 31.5e9, 10e-6)
    per_layer = real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(27, 26, 1))
    small = real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(4, 3, 1))
    assert small.attn_multiplier == 27 / 4 and small.moe_multiplier == 26 / 3
    assert small.dense_multiplier == 1.0 and small.unmodelled_dense_layers == 0
    real, modelled = CostModel(hw, per_layer), CostModel(hw, small)
    step = lambda c, layers, moe, dense: (layers * c.attention_s(1, 100)  # noqa: E731
                                           + moe * (c.router_s(1) + c.shared_s(1) + 6 * c.expert_s(1))
                                           + dense * c.dense_mlp_s(1) + c.lm_head_s(1))
    assert step(modelled, 4, 3, 1) == pytest.approx(step(real, 27, 26, 1), rel=1e-12)
    no_dense = CostModel(hw, real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(4, 4, 0)))
    assert no_dense.sizes.unmodelled_dense_layers == 1
    assert no_dense.lm_head_s(1) == pytest.approx(real.lm_head_s(1) + real.dense_mlp_s(1))


@pytest.mark.parametrize("name", TINY)
def test_transformers_offload_is_lossless_at_every_budget(name):
    """HF generate with accelerate's offload hooks: resident's tokens at top-k slots (every
    experts layer moved per forward), half the experts, and all (nothing moved)."""
    from baselines.transformers_offload import resident_layers

    resident, loaded = make_engine(name, "resident", None)
    ref = decode_all(resident, loaded.tokenizer)
    e, k = loaded.spec.num_experts, loaded.spec.top_k
    for slots in sorted({k, e // 2, e}):
        hf, _ = make_engine(name, "transformers", slots)
        gens = decode_all(hf, loaded.tokenizer)
        assert [g.tokens for g in gens] == [g.tokens for g in ref], f"{name} at {slots} slots"
        n_moe = len(loaded.spec.moe_layers)
        for g, r in zip(gens, ref):
            n_off = g.stats["offloaded_expert_layers"]
            assert g.stats["resident_expert_layers"] == resident_layers(slots, e, n_moe)
            assert n_off == n_moe - resident_layers(slots, e, n_moe)
            forwards = len(g.tokens)  # prefill + one per later token
            assert g.stats["n_transfers"] == n_off * forwards
            assert g.stats["accelerate_moved_bytes"] > 0 if n_off else g.stats["h2d_bytes"] == 0
            assert g.stats["h2d_hidden_frac"] == 0 or n_off == 0  # synchronous: nothing hidden
            if n_off:  # every offloaded forward waits for its copy: slower than resident
                assert g.commit_times_s[-1] - g.start_time_s > r.commit_times_s[-1] - r.start_time_s


def test_transformers_offload_charges_the_real_models_offloaded_bytes():
    """DeepSeek-V2-Lite sizes at 48 of 64 slots: 19 of its 26 layers fit, 7 x 64 experts x
    17.3 MB move per token, spread over the tiny model's offloaded layers."""
    from baselines.transformers_offload import resident_layers

    assert resident_layers(48, 64, 26) == 19 and resident_layers(6, 64, 26) == 2
    hf, loaded = make_engine("tiny_deepseek", "transformers", 48, hardware=dict(A100, charge="real"))
    g = decode_all(hf, loaded.tokenizer, n=5)[0]
    per_token = g.stats["h2d_bytes"] / len(g.tokens)
    assert per_token == pytest.approx(7 * 64 * 17_301_504, rel=1e-6)


def test_offloaded_and_resident_runs_charge_the_same_compute():
    """With a link that costs nothing, offloading must cost nothing: every compute step is
    charged the same whether the experts are HF's or the runtime's (a dense-MLP charge on
    MoE layers once slipped in when the offloaded experts were not recognised). The runtime's
    per-expert loop (offload.grouped=false) is HF's eager loop; its grouped kernel is charged
    as one call per round (costmodel.grouped_experts_s), less."""
    free = dict(A100, h2d_bandwidth_Bps=1e18, h2d_latency_s=0.0, charge="real")
    for name in ("tiny_deepseek", "tiny_qwen"):
        res, loaded = make_engine(name, "resident", None, hardware=free)
        lru, _ = make_engine(name, "lru", loaded.spec.top_k, hardware=free,
                             offload={"grouped": False})
        for r, l in zip(decode_all(res, loaded.tokenizer), decode_all(lru, loaded.tokenizer)):
            assert l.tokens == r.tokens and l.stats["demand_misses"] > 0
            assert l.commit_times_s[-1] - l.start_time_s == pytest.approx(
                r.commit_times_s[-1] - r.start_time_s, rel=1e-6)  # transfers: ~1e-11 s each


def test_transformers_sizes_its_device_map_from_the_budgets_gib():
    """budget=high of a DeepSeek-shaped model: accelerate gets the paper's 24 GiB (19 of
    DeepSeek-V2-Lite's 26 MoE layers fit whole, no INT4 draft charged), not Specter's 16 slots;
    the same share of the tiny model's layers stays resident, the link is charged the real
    model's 7 offloaded layers per token, and the record says what accelerate moved."""
    from specter.budget import resolve
    from specter.recipes import footprint

    cfg = RunConfig.from_dict({
        "model": {"name": "tiny_deepseek", "source": "project", "stands_for": "deepseek",
                  "budget_slots": {"high": 16}, "budget_gb": {"high": 24}},
        "budget": {"name": "high"}, "system": {"name": "transformers"},
        "dataset": {"name": "gsm8k"}, "hardware": {**A100, "charge": "real"}, "workload": {},
        "progress": False})
    loaded = load_model(cfg.model, torch.device("cpu"), progress=False)
    budget = resolve(cfg.budget, cfg.model, None, loaded.spec.num_experts, loaded.spec.top_k,
                     footprint(cfg.system), kv_tokens=144)
    assert (budget.whole_layers, budget.whole_layers_of, budget.slots) == (19, 26, 16)
    engine = build_engine(job_of(cfg, loaded, budget, torch.device("cpu")))
    n_moe = loaded.spec.num_moe_layers
    assert engine.n_resident == n_moe * 19 // 26 and engine.n_offloaded >= 1
    expert = 3 * 2048 * 1408 * 2
    assert engine.bytes_per_move * engine.n_offloaded == pytest.approx(7 * 64 * expert, abs=n_moe)
    engine.reset()
    g = engine.generate(loaded.tokenizer(PROMPTS[0])["input_ids"][:16], 4)
    assert g.stats["accelerate_moves_what"] == "all experts of the layer"
    assert g.stats["accelerate_moves"] == 4 * engine.n_offloaded  # prefill + 3 decode steps


def test_hit_rate_never_exceeds_its_slot_cap():
    e_k = {}
    for slots in (6, 64):
        lru, loaded = make_engine("tiny_deepseek", "lru", slots)
        gens = decode_all(lru, loaded.tokenizer)
        for g in gens:
            assert g.stats["hit_rate"] <= g.stats["hit_rate_cap"] + 1e-12
        e_k[slots] = [g.stats["hit_rate_cap"] for g in gens]
    assert all(c == 1.0 for c in e_k[64])  # every expert fits: nothing caps the hit rate
    # One token needs top-6 experts: 6 slots can hold them all, so the cap is 1 there too.
    assert all(c == 1.0 for c in e_k[6])


def test_offload_host_cost_is_charged_once_per_moe_layer_per_forward():
    """offload_layer_overhead_s (fit on a GPU: scripts/calibrate_gpu.py) is charged by the
    offload runtime on every MoE layer of every forward, and by nothing else."""
    free = dict(A100, h2d_bandwidth_Bps=1e18, h2d_latency_s=0.0)
    cost = 1e-3
    res, loaded = make_engine("tiny_deepseek", "resident", None, hardware=dict(free, offload_layer_overhead_s=cost))
    res0, _ = make_engine("tiny_deepseek", "resident", None, hardware=free)
    lru, _ = make_engine("tiny_deepseek", "lru", loaded.spec.top_k,
                         hardware=dict(free, offload_layer_overhead_s=cost), offload={"grouped": False})
    moe_layers = len(lru.runtime.modules)
    span = lambda g: g.commit_times_s[-1] - g.start_time_s  # noqa: E731
    for r, r0, l in zip(decode_all(res, loaded.tokenizer, 8), decode_all(res0, loaded.tokenizer, 8),
                        decode_all(lru, loaded.tokenizer, 8)):
        assert span(r) == span(r0)  # resident runs HF's experts: no offload runtime
        forwards = len(l.tokens)  # the prefill (first token) and one decode forward per later token
        assert span(l) - span(r) == pytest.approx(forwards * moe_layers * cost, rel=1e-6)


def test_draft_layer_cost_defaults_to_one_mlp_call():
    sizes = real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(4, 3, 1))
    base = HardwareProfile("h", 1e15, 4e12, 5e-6, 50e9, 1e-5, expert_overhead_s=2e-4)
    hits = [1] * 6
    stock = CostModel(base, sizes).draft_experts_s(hits)
    measured = CostModel(dataclasses.replace(base, draft_overhead_s=1.3e-3), sizes).draft_experts_s(hits)
    assert measured - stock == pytest.approx((1.3e-3 - 2e-4) * sizes.moe_multiplier, rel=1e-9)
    assert CostModel(base, sizes).offload_layer_s() == 0.0


def test_eviction_policy_is_chosen_by_name_and_lfu_keeps_the_busiest():
    from specter.errors import UserError
    from specter.offload.policy import LFU

    lfu = LFU()
    lfu.reset([0, 1, 2])  # first = first to evict among equals
    for e in (1, 1, 0):
        lfu.touch(e)
    assert lfu.victim({0, 1, 2}) == 2 and lfu.victim({0, 1}) == 0
    lfu.forget(2)
    assert lfu.victim({2, 1}) == 2  # a forgotten expert counts no uses
    resident, loaded = make_engine("tiny_qwen", "resident", None)
    ref = [g.tokens for g in decode_all(resident, loaded.tokenizer)]
    engine, _ = make_engine("tiny_qwen", "lru", loaded.spec.top_k, offload={"policy": "lfu"})
    assert all(isinstance(lc.policy, LFU) for lc in engine.runtime.cache.layers)
    assert [g.tokens for g in decode_all(engine, loaded.tokenizer)] == ref
    with pytest.raises(UserError, match="unknown offload.policy 'fifo'; choose one of: lfu, lru"):
        make_engine("tiny_qwen", "lru", 4, offload={"policy": "fifo"})


def test_a_batch_of_32_is_charged_by_hand_arithmetic_on_deepseek_sizes():
    """Batched work (issue: batched decoding): attention's projections over all 32 rows at
    once, each sequence's own KV read; routed experts by the tokens routed to each; one B=1
    row charges exactly what `attention_s` always did."""
    sizes = real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(27, 26, 1))
    hw = HardwareProfile("a100_pcie4_ideal", 312e12, 1.555e12, 5e-6, 31.5e9, 10e-6)
    cost = CostModel(hw, sizes)
    rows = [(1, 100 + 10 * i) for i in range(32)]  # decode: one token per sequence
    s = sizes
    proj = max(2 * 32 * s.attn_params / 312e12, s.attn_params * 2 / 1.555e12) + 6 * 5e-6
    kv = sum(c for _, c in rows) * s.kv_elems_per_token * 2 / 1.555e12
    scores = 4 * sum(c for _, c in rows) * s.heads * s.head_dim / 312e12
    assert cost.attention_batch_s(rows) == pytest.approx((proj + max(kv, scores)) * s.attn_multiplier,
                                                         rel=1e-12)
    assert cost.attention_batch_s([(5, 300)]) == cost.attention_s(5, 300)
    # weights are read once for the batch: 32 rows cost far less than 32 single forwards
    assert cost.attention_batch_s(rows) < 0.2 * sum(cost.attention_s(t, c) for t, c in rows)
    # an expert hit by 7 of the batch's tokens: one GEMM over 7 rows, weights read once
    e = s.expert_params
    assert cost.expert_s(7) == pytest.approx(
        (max(2 * 7 * e / 312e12, e * 2 / 1.555e12) + 3 * 5e-6) * s.moe_multiplier, rel=1e-12)


def test_quantized_experts_and_attention_are_charged_at_their_bits(tiny_models, tmp_path):
    """hardware.expert_bits / attn_bits (issue 26: a publication's deployment, e.g. HQQ 2-bit
    experts and 4-bit attention): each expert move carries its bits plus a scale and zero per
    group; the tokens are the same, the time less."""
    from experiments import records

    tiny_models("tiny_deepseek")
    fp16 = ["model=tiny_deepseek", "system=lru", "workload.items=1", "workload.max_new_tokens=8",
            "workload.stop_on_eos=false", "hardware=a100_pcie4_ideal", "hardware.charge=own",
            "progress=false"]

    def rows(name, *extra):
        from experiments import runner
        from specter.settings import run_config

        runner.run(run_config([*fp16, *extra, f"out_dir={tmp_path / name}"]), log=lambda *_: None)
        return records.load(tmp_path / name).iloc[0]

    full = rows("fp16")
    low = rows("q2", "hardware.expert_bits=2", "hardware.attn_bits=4", "hardware.quant_group=16")
    params, elem = int(full["charged.expert_params"]), int(full["charged.elem_bytes"])
    per_expert = params * 2 // 8 + -(-params // 16) * 4
    assert low["output_tokens"].tolist() == full["output_tokens"].tolist()
    assert low["n_transfers"] == full["n_transfers"] > 0
    assert low["h2d_bytes"] * (params * elem) == full["h2d_bytes"] * per_expert
    assert low["tpot_ms"] < full["tpot_ms"] and low["charged.expert_bits"] == 2


def test_every_builder_reads_one_rule_for_copying_under_the_cpus_own_clock(tmp_path):
    """The preflight and both builders (offload_model, the transformers baseline) refuse the
    same cases with the same sentence: some experts held but not all. budget=full passes the
    preflight and builds, the transformers path included (the sentence recommends it)."""
    from conftest import run_cli
    from specter.errors import UserError
    from specter.clock.kinds import clock_kind
    from specter.offload.build import WALL_CLOCK_OFFLOAD, refuse_wall_clock_offload

    for slots in (1, 7):
        with pytest.raises(UserError, match="needs a modelled link"):
            refuse_wall_clock_offload(clock_kind("wall"), "cpu", slots, 8)
    for clock, device, slots in (("wall", "cpu", 0), ("wall", "cpu", 8), ("virtual", "cpu", 2),
                                 ("wall", "cuda", 2)):
        refuse_wall_clock_offload(clock_kind(clock), device, slots, 8)
    common = ("model=tiny_deepseek", "system=transformers", "hardware=cpu", "workload.items=1",
              "workload.max_new_tokens=4", "progress=false")
    r = run_cli(*common, "budget=low", f"out_dir={tmp_path / 'low'}")
    assert r.returncode != 0 and WALL_CLOCK_OFFLOAD in r.stderr
    r = run_cli(*common, "budget=full", f"out_dir={tmp_path / 'full'}")
    assert r.returncode == 0, r.stderr[-2000:]
