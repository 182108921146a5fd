"""The predictive I/O orchestrator: the planner's rules on synthetic counters and timings,
the ELB, pins in the cache, and `system=specter` (and sp_e / sp_l, its ablations, the oracle
noise) token-identical to the target on every tiny architecture and budget."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY
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
    assert (sum(g.stats["prefetches"] for g in gens) > 0) == planned
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


# -- the orchestrator's schedule on a synthetic clock ---------------------------------------


class _Transfer:
    def __init__(self, nbytes, start, end, link):
        self.nbytes, self.start, self.end, self._link = nbytes, start, end, link

    def done(self):
        return self._link.t >= self.end


class _Link:
    """Compute time `t`; one copy engine free at `te`."""

    def __init__(self, bandwidth):
        self.t, self.te, self.bw = 0.0, 0.0, bandwidth

    def now(self):
        return self.t

    def compute(self, s):
        self.t += s


class _Cache:
    def __init__(self, layers, slots, link, nbytes):
        self.layers = [None] * layers
        self.slots, self.link, self.transfer_bytes = slots, link, nbytes
        self.res = [set(range(slots)) for _ in range(layers)]
        self.pins = [set() for _ in range(layers)]
        self.issued: list[tuple[float, int, int]] = []  # (time, layer, expert)

    def resident_set(self, l):
        return set(self.res[l])

    def pin(self, l, experts):
        self.pins[l].update(experts)

    def release_all_pins(self):
        for p in self.pins:
            p.clear()

    def load(self, l, e, avoid=frozenset()):
        victims = sorted(self.res[l] - self.pins[l] - set(avoid))
        if e in self.res[l] or not victims:
            return None
        self.res[l].remove(victims[0])
        self.res[l].add(e)
        start = max(self.link.t, self.link.te)
        self.link.te = start + self.transfer_bytes / self.link.bw
        self.issued.append((self.link.t, l, e))
        return _Transfer(self.transfer_bytes, start, self.link.te, self.link)


class _Runtime:
    def __init__(self, cache):
        self.cache, self.last_needed = cache, {}


def _drive(orch, link, routing, step_s):
    """One window: each draft step routes `routing[i][l]` at layer l and takes step_s."""
    k = len(routing)
    for i, per_layer in enumerate(routing):
        orch.on_forward("draft")
        for l, experts in enumerate(per_layer):
            orch.on_draft_experts(l, torch.tensor([experts]))
        link.compute(step_s)
        orch.after_draft_step(i + 1, k)


def test_orchestrator_phases_follow_transfer_time_and_step_time():
    """Cold start after ceil(0.2K) steps; the next boundary after as many steps as the batch
    takes to move (bandwidth known from the profile, step time measured); final cleanup at the
    window's end; pins never exceed the slots; nothing evicts a predicted expert."""
    from specter.pio.orchestrator import Orchestrator

    link = _Link(bandwidth=1000.0)  # 1000 B/s
    cache = _Cache(layers=2, slots=4, link=link, nbytes=1000)  # 1 s per expert copy
    elb = ExpertLookaheadBuffer(2, 16, torch.device("cpu"))
    orch = Orchestrator(_Runtime(cache), link, elb, slots=4, top_m=1, bandwidth_Bps=1000.0,
                        latency_s=0.0)
    # K=10 steps of 1 s; each step routes a new expert per layer (never resident).
    routing = [[[8 + i % 8], [8 + (i + 3) % 8]] for i in range(10)]
    _drive(orch, link, routing, step_s=1.0)
    times = sorted({t for t, _, _ in cache.issued})
    # Cold start: ceil(0.2*10) = 2 steps; the batch of 2 copies (1 per layer, top_m=1) takes
    # 2 s = 2 steps, so the next boundary is at step 4, then 6, ...
    assert times[:3] == [2.0, 4.0, 6.0]
    assert orch.stats.boundaries >= 3
    assert all(len(p) <= 4 for p in cache.pins)
    # Plans stop once every layer's plan holds its 4 slots (here: 4 loads per layer).
    assert orch.stats.loads == 8 and orch.stats.full_windows == 1
    orch.end_window()
    assert all(not p for p in cache.pins) and orch.stats.windows == 1


def test_orchestrator_late_plan_waits_for_the_whole_window():
    from specter.pio.orchestrator import Orchestrator

    link = _Link(bandwidth=1000.0)
    cache = _Cache(layers=1, slots=4, link=link, nbytes=1000)
    elb = ExpertLookaheadBuffer(1, 16, torch.device("cpu"))
    orch = Orchestrator(_Runtime(cache), link, elb, slots=4, top_m=4, bandwidth_Bps=1000.0,
                        latency_s=0.0, mode="late")
    _drive(orch, link, [[[9]], [[10]], [[9]], [[11]], [[0]]], step_s=1.0)
    assert orch.stats.boundaries == 1 and {t for t, _, _ in cache.issued} == {5.0}
    # Ranked by count: 9 (twice) first; 0 is resident and pinned, so it is never evicted.
    assert [e for _, _, e in cache.issued] == [9, 10, 11] and 0 in cache.res[0]


# -- workload.temperature through the runner -------------------------------------------------


def test_sampling_through_the_runner_repeats_per_seed_and_is_refused_for_greedy_systems(tmp_path):
    import yaml

    from conftest import REPO
    from experiments import records, runner
    from specter.config import RunConfig
    from test_offload import A100

    def cfg(system, temperature, seed, out):
        return RunConfig.from_dict({
            "model": yaml.safe_load((REPO / "conf/model/tiny_qwen.yaml").read_text()),
            "budget": {"name": "low"}, "system": {"name": system}, "dataset": {"name": "gsm8k"},
            "hardware": A100, "spec": {"k": 4}, "seed": seed, "out_dir": str(tmp_path / out),
            "workload": {"items": 2, "max_new_tokens": 16, "repeats": 2,
                         "temperature": temperature}, "progress": False})

    quiet = lambda *_: None  # noqa: E731
    for out, seed in (("a", 0), ("b", 0), ("c", 1)):
        runner.run(cfg("specter", 1.5, seed, out), log=quiet)
    runner.run(cfg("specter", 0.0, 0, "greedy"), log=quiet)
    toks = {o: [list(t) for t in records.load(tmp_path / o).sort_values(["request_id", "repeat"])
                ["output_tokens"]] for o in ("a", "b", "c", "greedy")}
    assert toks["a"] == toks["b"]  # the same seed: the same samples
    assert toks["a"] != toks["c"] and toks["a"] != toks["greedy"]
    assert toks["a"][0] != toks["a"][1]  # repeats draw differently
    with pytest.raises(UserError, match="decodes greedily only"):
        runner.run(cfg("lru", 1.0, 0, "bad"), log=quiet)
    assert not (tmp_path / "bad").exists()


def test_system_settings_on_the_command_line_are_one_sentence_when_wrong(tmp_path):
    from conftest import run_cli

    wrong_system = run_cli("system=lru", "system.shared=false", f"out_dir={tmp_path}")
    unknown = run_cli("system=specter", "system.sharing=false", f"out_dir={tmp_path}")
    for res, text in ((wrong_system, "system.shared applies to specter only"),
                      (unknown, "unknown setting 'system.sharing'")):
        assert res.returncode == 2 and text in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert not tmp_path.joinpath("records").exists()
