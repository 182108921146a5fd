"""The predictive I/O orchestrator: the planner's rules on synthetic counters and timings,
the ELB, pins in the cache, and `system=specter` (and sp_e / sp_l, its ablations, the oracle
noise) token-identical to the target on every tiny architecture and budget."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import PROMPTS, TINY
from specter.errors import UserError
from specter.pio import planner
from specter.pio.elb import ExpertLookaheadBuffer
from test_offload import decode_all, make_engine

# -- planner: pure rules ---------------------------------------------------------------------


def test_cold_start_and_chunk_sizing():
    assert [planner.cold_start_steps(k) for k in (1, 2, 4, 5, 6, 16, 32)] == [1, 1, 1, 1, 2, 4, 7]
    assert planner.cold_start_steps(16, 0.5) == 8 and planner.cold_start_steps(3, 1.0) == 3
    # The next chunk computes about as long as the batch moves: ceil(batch / step), >= 1.
    assert planner.next_chunk_steps(batch_s=10e-3, step_s=2.5e-3) == 4
    assert planner.next_chunk_steps(batch_s=10.1e-3, step_s=2.5e-3) == 5
    assert planner.next_chunk_steps(batch_s=0.0, step_s=1e-3) == 1
    assert planner.next_chunk_steps(batch_s=1e-3, step_s=0.0) == 1  # no step measured yet
    assert planner.batch_seconds(3, 1000, 1e6, 1e-4) == pytest.approx(3 * (1e-3 + 1e-4))


def test_plan_layer_ranks_pins_loads_and_caps():
    counts = [0, 5, 2, 2, 9, 0, 1, 3]  # ranked: 4(9) 1(5) 7(3) 2(2) 3(2) 6(1)
    assert planner.rank(counts) == [4, 1, 7, 2, 3, 6]
    b = planner.plan_layer(counts, resident={1, 3, 5}, planned=set(), slots=8, top_m=2)
    assert b.pin == [1] and b.load == [4, 7]  # stops after top_m loads: 3 (resident) not pinned
    b = planner.plan_layer(counts, resident={1, 3, 5}, planned=set(), slots=3, top_m=8)
    assert b.pin == [1] and b.load == [4, 7]  # the plan holds `slots` experts
    b = planner.plan_layer(counts, resident={1}, planned={4, 1}, slots=4, top_m=8)
    assert b.pin == [] and b.load == [7, 2]  # already planned: skipped, counted toward slots
    b = planner.plan_layer([0] * 8, resident=set(), planned=set(), slots=4, top_m=4)
    assert b.pin == [] and b.load == []  # count >= 1 only
    plans = planner.plan_batch([counts, [1, 0, 0, 0, 0, 0, 0, 0]], [set(), {0}], [set(), set()], 2, 2)
    assert [p.load for p in plans] == [[4, 1], []] and plans[1].pin == [0]
    assert planner.plan_full([{1, 2}, {3, 4}], 2) and not planner.plan_full([{1, 2}, {3}], 2)


def test_corrupt_replaces_with_wrong_ids_only():
    counts = [[3, 2, 0, 0, 0, 0, 0, 0, 1, 0] * 4]  # 40 experts
    resident = [{2, 3}]
    rng = random.Random(0)
    replaced_total = 0
    for _ in range(200):
        batch = planner.plan_batch(counts, resident, [set()], slots=40, top_m=4)
        before = list(batch[0].load)
        replaced_total += planner.corrupt(batch, counts, resident, 0.5, rng)
        for old, new in zip(before, batch[0].load):
            assert new == old or (counts[0][new] == 0 and new not in resident[0])
        assert len(set(batch[0].load)) == len(batch[0].load)
    assert 0.4 < replaced_total / 800 < 0.6  # about the asked share
    batch = planner.plan_batch(counts, resident, [set()], slots=40, top_m=4)
    assert planner.corrupt(batch, counts, resident, 0.0, rng) == 0


def test_running_mean_starts_from_the_prior_then_tracks():
    m = planner.RunningMean(prior=10.0, weight=0.5)
    assert m.value == 10.0
    m.update(float("nan"))
    m.update(-1.0)
    assert m.value == 10.0 and m.samples == 0
    m.update(2.0)
    assert m.value == 2.0
    m.update(4.0)
    assert m.value == 3.0


def test_elb_counts_like_bincount_and_snapshots_once_per_call():
    elb = ExpertLookaheadBuffer(3, 8, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ref = torch.zeros(3, 8, dtype=torch.int64)
    for _ in range(10):
        layer = int(torch.randint(0, 3, (), generator=g))
        idx = torch.randint(0, 8, (4, 2), generator=g)
        elb.add(layer, idx)
        ref[layer] += torch.bincount(idx.flatten(), minlength=8)
    assert elb.counts.dtype == torch.int32
    assert elb.snapshot() == ref.tolist() and elb.snapshots == 1
    elb.reset()
    assert elb.snapshot() == [[0] * 8] * 3


# -- the cache's pins ------------------------------------------------------------------------


def test_pinned_experts_survive_later_loads_until_released():
    lru, _ = make_engine("tiny_deepseek", "lru", 6)
    cache = lru.runtime.cache
    cache.reset()  # experts 0..5 resident in every layer
    cache.pin(0, [0, 1, 2, 3, 4])
    cache.load(0, 9)  # evicts 5, the only unpinned one
    assert cache.resident_set(0) == {0, 1, 2, 3, 4, 9}
    cache.pin(0, [9])
    assert cache.free_slots(0) == 0 and cache.load(0, 10) is None  # everything is held
    assert cache.load(1, 10) is not None  # pins are per layer
    cache.release_pins(0)
    assert cache.load(0, 10) is not None and len(cache.resident_set(0)) == 6


# -- system=specter -------------------------------------------------------------------------

VARIANTS = [
    {"name": "specter"},
    {"name": "sp_e"},
    {"name": "sp_l"},
    {"name": "specter", "shared": False},
    {"name": "specter", "orchestrator": False},
    {"name": "specter", "prefetch_noise": 0.5},
]


@pytest.mark.parametrize("name", TINY)
def test_specter_is_lossless_on_every_architecture_and_budget(name):
    resident, loaded = make_engine(name, "resident", None)
    ref = [g.tokens for g in decode_all(resident, loaded.tokenizer)]
    e, k = loaded.spec.num_experts, loaded.spec.top_k
    for slots, depth in ((k, 3), (k, 8), ((k + e) // 2, 8), ((k + e) // 2, 32)):  # 32 > tokens
        eng, _ = make_engine(name, "specter", slots, spec={"k": depth})
        gens = decode_all(eng, loaded.tokenizer)
        assert [g.tokens for g in gens] == ref, f"{name} at {slots} slots, K={depth}"
        assert sum(g.stats["prefetches"] for g in gens) > 0


@pytest.fixture(scope="module")
def qwen_reference():
    resident, loaded = make_engine("tiny_qwen", "resident", None)
    return [g.tokens for g in decode_all(resident, loaded.tokenizer)], loaded


@pytest.mark.parametrize("system", VARIANTS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_single_plans_ablations_and_wrong_predictions_stay_lossless(system, qwen_reference):
    ref, loaded = qwen_reference
    eng, _ = make_engine("tiny_qwen", system, loaded.spec.top_k + 2, spec={"k": 6})
    gens = decode_all(eng, loaded.tokenizer)
    assert [g.tokens for g in gens] == ref
    planned = system.get("orchestrator", True)
    assert all((g.stats["prefetches"] > 0) == planned for g in gens)
    if system["name"] in ("sp_e", "sp_l"):
        assert all(g.stats["plan_boundaries_per_window"] == 1.0 for g in gens)
    if system.get("prefetch_noise"):
        assert sum(g.stats["prefetch_corrupted"] for g in gens) > 0


def test_serial_experts_match_grouped_within_rounding_and_cost_more():
    """reorder=false: one GEMV per (token, expert); the same verification within fp32
    rounding, charged more on the virtual clock."""
    loaded_runs = {}
    for reorder in (True, False):
        eng, loaded = make_engine("tiny_deepseek", {"name": "specter", "reorder": reorder}, 8,
                                  spec={"k": 6})
        loaded_runs[reorder] = decode_all(eng, loaded.tokenizer)
    grouped, serial = loaded_runs[True], loaded_runs[False]
    assert [g.tokens for g in grouped] == [g.tokens for g in serial]  # tiny model: no tie flips
    verify = lambda gens: sum(g.stats["verify_ms_per_window"] for g in gens)  # noqa: E731
    assert verify(serial) > verify(grouped)


def test_orchestrator_raises_hit_rate_over_on_demand_loading():
    """The same engine with and without the planner, same K and slots: the plan covers most
    of verification's demand, and wrong IDs (oracle noise) lower its precision and cost time."""
    stats = {}
    for label, system in (("none", {"name": "specter", "orchestrator": False}),
                          ("pio", {"name": "specter"}),
                          ("noisy", {"name": "specter", "prefetch_noise": 0.75})):
        eng, loaded = make_engine("tiny_deepseek", system, 8, spec={"k": 8})
        stats[label] = decode_all(eng, loaded.tokenizer, n=24)
    mean = lambda label, key: sum(g.stats[key] for g in stats[label]) / len(stats[label])  # noqa: E731
    assert mean("pio", "hit_rate") > mean("none", "hit_rate") + 0.1
    assert mean("pio", "prefetch_precision") > 0.8
    assert mean("noisy", "prefetch_precision") < mean("pio", "prefetch_precision") - 0.3
    assert mean("noisy", "hit_rate") < mean("pio", "hit_rate")
    for label in ("none", "noisy"):
        assert [g.tokens for g in stats[label]] == [g.tokens for g in stats["pio"]]


def test_knobs_are_refused_by_systems_that_do_not_have_them():
    from experiments.systems import check_system
    from specter.config import SystemConfig

    check_system(SystemConfig(name="specter", shared=False, top_m=3))
    check_system(SystemConfig(name="sp_l", top_m=3))
    with pytest.raises(UserError, match="system.shared applies to specter only"):
        check_system(SystemConfig(name="lru_s", shared=False))
    with pytest.raises(UserError, match="prefetch_noise"):
        check_system(SystemConfig(name="lru", prefetch_noise=0.5))
