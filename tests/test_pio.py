"""The predictive I/O orchestrator: the planner's rules on synthetic counters and timings,
the ELB, holds in the cache, and `system=specter` (and sp_e / sp_l, its ablations, the oracle
noise) token-identical to the target on every tiny architecture and budget."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY
from specter.pio import planner
from specter.pio.elb import ExpertLookaheadBuffer
from steering import exact_draft_layers, forced_predictions
from test_offload import A100, decode_all, make_engine

# -- planner: pure rules ---------------------------------------------------------------------


def test_cold_start_and_chunk_sizing():
    ks = (1, 2, 4, 5, 6, 8, 10, 16, 32)
    # The artifact's max(1, int(0.2 K)) by default; ours before: max(1, ceil(0.2 K)).
    assert [planner.cold_start_steps(k) for k in ks] == [1, 1, 1, 1, 1, 1, 2, 3, 6]
    assert [planner.cold_start_steps(k, rounding="ceil") for k in ks] == [1, 1, 1, 1, 2, 2, 2, 4, 7]
    assert planner.cold_start_steps(16, 0.5) == 8 and planner.cold_start_steps(3, 1.0) == 3
    with pytest.raises(ValueError, match="rounding"):
        planner.cold_start_steps(8, rounding="round")
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
    assert b.hold == [1] and b.load == [4, 7]  # stops after top_m loads: 3 (resident) not held
    b = planner.plan_layer(counts, resident={1, 3, 5}, planned=set(), slots=3, top_m=8)
    assert b.hold == [1] and b.load == [4, 7]  # the plan holds `slots` experts
    b = planner.plan_layer(counts, resident={1}, planned={4, 1}, slots=4, top_m=8)
    assert b.hold == [] and b.load == [7, 2]  # already planned: skipped, counted toward slots
    b = planner.plan_layer([0] * 8, resident=set(), planned=set(), slots=4, top_m=4)
    assert b.hold == [] and b.load == []  # count >= 1 only
    plans = planner.plan_batch([counts, [1, 0, 0, 0, 0, 0, 0, 0]], [set(), {0}], [set(), set()], 2, 2)
    assert [p.load for p in plans] == [[4, 1], []] and plans[1].hold == [0]
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
    # The artifact's EMA: the prior is the starting value, each sample moves it by the weight.
    a = planner.RunningMean(prior=12e9, weight=0.25, blend=True)
    a.update(4e9)
    assert a.value == pytest.approx(10e9) and a.samples == 1


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


# -- the cache's holds ------------------------------------------------------------------------


def test_held_experts_survive_later_loads_until_released():
    lru, _ = make_engine("tiny_deepseek", "lru", 6)
    cache = lru.runtime.cache
    cache.reset()  # experts 0..5 resident in every layer
    cache.hold(0, [0, 1, 2, 3, 4])
    cache.load(0, 9)  # evicts 5, the only unheld one
    assert cache.resident_set(0) == {0, 1, 2, 3, 4, 9}
    cache.hold(0, [9])
    assert cache.free_slots(0) == 0 and cache.load(0, 10) is None  # everything is held
    assert cache.load(1, 10) is not None  # holds are per layer
    cache.release_holds(0)
    assert cache.load(0, 10) is not None and len(cache.resident_set(0)) == 6


# -- system=specter -------------------------------------------------------------------------

# Our first reading of every rule where the artifact differs (the artifact's are the defaults).
OURS = {"cold_start_round": "ceil", "final_plan": True, "wait_last_batch": False,
        "bandwidth_prior_Bps": None, "step_prior_s": None, "top_m": 2}

VARIANTS = [
    {"name": "specter"},
    {"name": "sp_e"},
    {"name": "sp_l"},
    {"name": "sp_l", "wait_last_batch": False},
    {"name": "specter", "shared": False},  # kv_copy (the artifact's SIC off)
    {"name": "specter", "shared": False, "kv_copy": False},  # its own KV
    {"name": "specter", "orchestrator": False},
    {"name": "specter", "overlap": False},
    {"name": "specter", "orchestrator": False, "shared": False, "reorder": False,
     "overlap": False},  # the ablation's "none"
    {"name": "specter", "prefetch_noise": 0.5},
    {"name": "specter", **OURS},
]


def test_staging_buffers_take_prefetches_beyond_the_slots_losslessly():
    """budget.staging: a plan may hold more than the resident slots; the extra experts land in
    the shared staging pool, serve their layer's verification, and leave; tokens unchanged."""
    resident, loaded = make_engine("tiny_deepseek", "resident", None)
    ref = [g.tokens for g in decode_all(resident, loaded.tokenizer)]
    k = loaded.spec.top_k
    plain, _ = make_engine("tiny_deepseek", "specter", k, spec={"k": 8})
    staged, _ = make_engine("tiny_deepseek", "specter", k, spec={"k": 8}, staging=8)
    # A draft that routes as verification will: the staged copies are experts verification
    # needs, whatever the weights.
    for eng in (plain, staged):
        eng.draft.draft_mode.draft_layers = exact_draft_layers(eng.model, eng.runtime.cache.store)
    a, b = decode_all(plain, loaded.tokenizer), decode_all(staged, loaded.tokenizer)
    assert [g.tokens for g in b] == ref
    assert sum(g.stats["staged_loads"] for g in a) == 0 < sum(g.stats["staged_loads"] for g in b)
    assert sum(g.stats["hit_rate"] for g in b) > sum(g.stats["hit_rate"] for g in a)
    cache = staged.runtime.cache
    assert cache.staging == 8 and len(cache.pool_free) == 8  # every buffer back after a request
    assert staged.memory.param_bytes - plain.memory.param_bytes == 8 * cache.pool[0].numel() * 4


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


def drafting_windows(accepted_lens: list[int], limit: int) -> int:
    """How many of a request's windows drafted: a window that starts one token short of the
    limit has nothing to draft (K_eff = 0) and makes no plan. The prefill commits the first
    token; each window commits its accepted drafts and the target's token."""
    committed, n = 1, 0
    for acc in accepted_lens:
        n += committed < limit - 1
        committed += acc + 1
    return n


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
    if system["name"] in ("sp_e", "sp_l"):  # one plan per window that drafts
        for g in gens:
            assert round(g.stats["plan_boundaries_per_window"] * g.stats["windows"]) == \
                drafting_windows(g.stats["accepted_lens"], 20)
    if system.get("prefetch_noise"):
        assert sum(g.stats["prefetch_corrupted"] for g in gens) > 0
    # Every row names the rules that ran.
    rec = gens[0].stats
    assert rec["overlap"] == system.get("overlap", True)
    assert rec["draft_kv"] == ("shared" if system.get("shared", True) else
                               "copied" if system.get("kv_copy", True) else "own")
    if planned:
        assert rec["wait_last_batch"] == system.get("wait_last_batch", True)
        assert rec["top_m"] == (system.get("top_m") or loaded.spec.top_k + 2)  # None: the slots
    if planned and system["name"] == "specter":
        assert rec["cold_start_round"] == system.get("cold_start_round", "floor")
        assert rec["final_plan"] == system.get("final_plan", False)
        assert rec["bandwidth_prior_Bps"] == system.get("bandwidth_prior_Bps", 12e9)


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
    """The same engine with and without the planner, same K and slots, with a draft whose
    experts are the target's (`exact_draft_layers`: it routes as verification will, whatever
    the weights): the plan's copies are what verification needs, it raises the hit rate, and
    wrong IDs (oracle noise) lower its precision. (How much the INT4 draft's plan gains is a
    measured result: experiment=cache and experiment=oracle.)"""
    stats = {}
    for label, system in (("none", {"name": "specter", "orchestrator": False}),
                          ("pio", {"name": "specter"}),
                          ("noisy", {"name": "specter", "prefetch_noise": 0.75})):
        eng, loaded = make_engine("tiny_deepseek", system, 8, spec={"k": 8})
        eng.draft.draft_mode.draft_layers = exact_draft_layers(loaded.model,
                                                               eng.runtime.cache.store)
        stats[label] = decode_all(eng, loaded.tokenizer, n=24)
    mean = lambda label, key: sum(g.stats[key] for g in stats[label]) / len(stats[label])  # noqa: E731
    assert mean("pio", "hit_rate") > mean("none", "hit_rate")
    assert mean("pio", "prefetch_precision") > 0.9  # all but rounding ties
    assert mean("noisy", "prefetch_precision") < mean("pio", "prefetch_precision") - 0.3
    assert mean("noisy", "hit_rate") < mean("pio", "hit_rate")
    for label in ("none", "noisy"):
        assert [g.tokens for g in stats[label]] == [g.tokens for g in stats["pio"]]


def test_wait_last_batch_serial_loading_and_kv_copy_are_charged():
    """wait_last_batch: verification waits for the last batch, counted; overlap=false: misses
    copied one by one, more exposed wait than overlapped demand loading; kv_copy: the draft
    reads the target's KV (acceptance as the shared instance's), the copy charged on the
    clock at read + write of the KV bytes."""
    def run(name="specter", hardware=A100, force=False, **knobs):
        eng, loaded = make_engine("tiny_deepseek", {"name": name, **knobs}, 8, hardware=hardware,
                                  spec={"k": 6})
        if force:  # every plan has copies to issue, whatever the model routes to
            forced_predictions(eng)
        return decode_all(eng, loaded.tokenizer)

    total = lambda gens, key: sum(g.stats[key] for g in gens)  # noqa: E731
    slow = {**A100, "h2d_bandwidth_Bps": 5e8}  # Specter's last batch still in flight at the end
    for name, hardware in (("sp_l", A100), ("specter", slow)):
        blocked = run(name, hardware, force=True)
        per_expert = run(name, hardware, force=True, wait_last_batch=False)
        assert total(blocked, "last_batch_wait_ms") > 0, name
        assert total(per_expert, "last_batch_wait_ms") == 0, name
        # The wait is the link's: exposed, and inside each request's verification time.
        assert total(blocked, "exposed_wait_ms") >= total(blocked, "last_batch_wait_ms") - 1e-9
        for g in blocked:
            s = g.stats
            assert s["verify_ms_per_window"] * s["windows"] >= s["last_batch_wait_ms"] - 1e-9
        assert [g.tokens for g in blocked] == [g.tokens for g in per_expert]

    overlapped, serial = run(orchestrator=False), run(orchestrator=False, overlap=False)
    assert total(serial, "exposed_wait_ms") > total(overlapped, "exposed_wait_ms")
    assert total(serial, "demand_misses") == total(overlapped, "demand_misses")
    assert [g.tokens for g in serial] == [g.tokens for g in overlapped]

    shared, copied = run(orchestrator=False), run(orchestrator=False, shared=False)
    assert [g.stats["accepted_lens"] for g in copied] == [g.stats["accepted_lens"] for g in shared]
    assert all(g.stats["kv_copy_bytes"] > 0 for g in copied)
    assert all(g.stats["kv_copy_bytes"] == 0 for g in shared)
    draft_s = lambda gens: sum(g.stats["draft_ms_per_window"] * g.stats["windows"]  # noqa: E731
                               for g in gens) / 1e3
    # Read + write of the KV bytes, one copy kernel per layer's K and V, once per window.
    assert 0 < total(copied, "kv_copies") <= total(copied, "windows")
    layers = len(make_engine("tiny_deepseek", "lru_s", 8)[0].model.model.layers)
    copy_s = (2 * total(copied, "kv_copy_bytes") / A100["mem_bandwidth_Bps"]
              + total(copied, "kv_copies") * 2 * layers * A100["launch_overhead_s"])
    assert draft_s(copied) - draft_s(shared) == pytest.approx(copy_s, rel=1e-6)


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

    def mark(self):
        return self.t

    def elapsed(self, start, end, wait=False):
        return end - start

    def span(self, t):
        return (t.start, t.end) if t.done() else None

    def compute(self, s):
        self.t += s

    def wait(self, t):
        self.t = max(self.t, t.end)


class _Cache:
    def __init__(self, layers, slots, link, nbytes):
        self.layers = [None] * layers
        self.slots, self.link, self.transfer_bytes = slots, link, nbytes
        self.res = [set(range(slots)) for _ in range(layers)]
        self.holds = [set() for _ in range(layers)]
        self.issued: list[tuple[float, int, int]] = []  # (time, layer, expert)
        self.inflight: dict[tuple[int, int], _Transfer] = {}
        self.staging = 0  # no staging buffers: a load that finds no slot stays unplanned

    def stage(self, l, e):
        return None

    def wait(self, l, e):
        t = self.inflight.pop((l, e), None)
        if t is not None:
            self.link.wait(t)

    def resident_set(self, l):
        return set(self.res[l])

    def hold(self, l, experts):
        self.holds[l].update(experts)

    def release_all_holds(self):
        for p in self.holds:
            p.clear()

    def load(self, l, e, avoid=frozenset()):
        victims = sorted(self.res[l] - self.holds[l] - set(avoid))
        if e in self.res[l] or not victims:
            return None
        self.res[l].remove(victims[0])
        self.res[l].add(e)
        start = max(self.link.t, self.link.te)
        self.link.te = start + self.transfer_bytes / self.link.bw
        self.issued.append((self.link.t, l, e))
        self.inflight[(l, e)] = _Transfer(self.transfer_bytes, start, self.link.te, self.link)
        return self.inflight[(l, e)]


class _Runtime:
    def __init__(self, cache):
        self.cache, self.stats = cache, SimpleNamespace(last_needed={})
        self.host = SimpleNamespace(misses=False)  # the orchestrator hands the host nothing


def _drive(orch, link, routing, step_s):
    """One window: each draft step routes `routing[i][l]` at layer l and takes step_s."""
    k = len(routing)
    for i, per_layer in enumerate(routing):
        orch.forward("draft", 1, 1)
        for l, experts in enumerate(per_layer):
            orch.on_draft_experts(l, torch.tensor([experts]))
        link.compute(step_s)
        orch.draft_step(i + 1, k)


def test_orchestrator_phases_follow_transfer_time_and_step_time():
    """Cold start after ceil(0.2K) steps; the next boundary after as many steps as the batch
    takes to move (bandwidth known from the profile, step time measured); final cleanup at the
    window's end; holds never exceed the slots; nothing evicts a predicted expert."""
    from specter.pio.orchestrator import Orchestrator, PlanRules

    link = _Link(bandwidth=1000.0)  # 1000 B/s
    cache = _Cache(layers=2, slots=4, link=link, nbytes=1000)  # 1 s per expert copy
    elb = ExpertLookaheadBuffer(2, 16, torch.device("cpu"))
    orch = Orchestrator(_Runtime(cache), link, elb, PlanRules(top_m=1, bandwidth_Bps=1000.0),
                        slots=4, latency_s=0.0)
    # K=10 steps of 1 s; each step routes a new expert per layer (never resident).
    routing = [[[8 + i % 8], [8 + (i + 3) % 8]] for i in range(10)]
    _drive(orch, link, routing, step_s=1.0)
    times = sorted({t for t, _, _ in cache.issued})
    # Cold start: ceil(0.2*10) = 2 steps; the batch of 2 copies (1 per layer, top_m=1) takes
    # 2 s = 2 steps, so the next boundary is at step 4, then 6, ...
    assert times[:3] == [2.0, 4.0, 6.0]
    assert orch.stats.boundaries >= 3
    assert all(len(p) <= 4 for p in cache.holds)
    # Plans stop once every layer's plan holds its 4 slots (here: 4 loads per layer).
    assert orch.stats.loads == 8 and orch.stats.full_windows == 1
    orch.window_end()
    assert all(not p for p in cache.holds) and orch.stats.windows == 1


def _synthetic(k, cold_start_round="floor", final_plan=False, top_m=1, layers=2):
    """One window of k 1-s draft steps, each routing a new (absent) expert per layer; copies
    take 1 s each. Returns the orchestrator, the link and the cache."""
    from specter.pio.orchestrator import Orchestrator, PlanRules

    link = _Link(bandwidth=1000.0)
    cache = _Cache(layers=layers, slots=4, link=link, nbytes=1000)
    elb = ExpertLookaheadBuffer(layers, 16, torch.device("cpu"))
    rules = PlanRules(top_m=top_m, bandwidth_Bps=1000.0, cold_start_round=cold_start_round,
                      final_plan=final_plan)
    orch = Orchestrator(_Runtime(cache), link, elb, rules, slots=4, latency_s=0.0)
    _drive(orch, link, [[[8 + (i + 3 * l) % 8] for l in range(layers)] for i in range(k)], 1.0)
    return orch, link, cache


def test_cold_start_rounding_sets_the_first_boundary():
    """K=8: the artifact's max(1, int(1.6)) = 1 step before the first plan; ceil: 2."""
    for rounding, first in (("floor", 1.0), ("ceil", 2.0)):
        _, _, cache = _synthetic(8, cold_start_round=rounding)
        assert min(t for t, _, _ in cache.issued) == first, rounding


def test_final_plan_and_the_last_batch_wait():
    """K=4, floor: plans after steps 1 and 3 (2 copies of 1 s each: chunk 2 steps); the next
    boundary would be step 5 > K. final_plan=false (the artifact): no plan after step 4;
    true: one more with the whole window's counts. Verification (wait_last_batch) then
    waits until the last copy has landed, and counts the wait."""
    orch, link, cache = _synthetic(4)
    assert sorted({t for t, _, _ in cache.issued}) == [1.0, 3.0] and orch.stats.boundaries == 2
    assert link.t == 4.0 and link.te == 5.0  # the step-3 batch lands at 5 s
    orch.forward("verify", 1, 1)
    assert link.t == 5.0 and orch.stats.last_batch_wait_s == pytest.approx(1.0)
    assert orch.stats.as_record()["last_batch_wait_ms"] == pytest.approx(1000.0)
    orch, link, cache = _synthetic(4, final_plan=True)
    assert sorted({t for t, _, _ in cache.issued}) == [1.0, 3.0, 4.0] and orch.stats.boundaries == 3
    orch.wait_last_batch = False
    orch.forward("verify", 1, 1)
    assert link.t == 4.0 and orch.stats.last_batch_wait_s == 0.0


def test_orchestrator_late_plan_waits_for_the_whole_window():
    from specter.pio.orchestrator import Orchestrator, PlanRules

    link = _Link(bandwidth=1000.0)
    cache = _Cache(layers=1, slots=4, link=link, nbytes=1000)
    elb = ExpertLookaheadBuffer(1, 16, torch.device("cpu"))
    orch = Orchestrator(_Runtime(cache), link, elb,
                        PlanRules(top_m=4, bandwidth_Bps=1000.0, mode="late"), slots=4,
                        latency_s=0.0)
    _drive(orch, link, [[[9]], [[10]], [[9]], [[11]], [[0]]], step_s=1.0)
    assert orch.stats.boundaries == 1 and {t for t, _, _ in cache.issued} == {5.0}
    # Ranked by count: 9 (twice) first; 0 is resident and held, so it is never evicted.
    assert [e for _, _, e in cache.issued] == [9, 10, 11] and 0 in cache.res[0]


# -- workload.temperature through the runner -------------------------------------------------


class _QueuedLink(_Link):
    """A GPU's clock as the orchestrator sees it: a mark is a queued event, reached only once
    a later mark is taken; reading the clock (`now`) would synchronise, and is counted."""

    def __init__(self, bandwidth):
        super().__init__(bandwidth)
        self.marks, self.reads = [], 0

    def now(self):
        self.reads += 1
        return self.t

    def mark(self):
        self.marks.append(self.t)
        return len(self.marks) - 1

    def elapsed(self, start, end, wait=False):
        if end == len(self.marks) - 1 and not wait:
            return None  # the device has not reached the newest mark yet
        return self.marks[end] - self.marks[start]


def test_draft_steps_are_timed_without_reading_the_clock():
    """issue 25 item 1: the orchestrator times draft steps by marks on the compute timeline,
    never by a clock read (on CUDA a device sync); a step the device has not finished is
    timed at a later step, in order, so the step-time EMA sees every step."""
    from specter.pio.orchestrator import Orchestrator, PlanRules

    link = _QueuedLink(bandwidth=1000.0)
    cache = _Cache(layers=2, slots=4, link=link, nbytes=1000)
    elb = ExpertLookaheadBuffer(2, 16, torch.device("cpu"))
    orch = Orchestrator(_Runtime(cache), link, elb, PlanRules(top_m=1, bandwidth_Bps=1000.0),
                        slots=4, latency_s=0.0)
    seen = []
    orch.step_s.update = lambda s: seen.append(s)
    for i in range(1, 5):
        orch.forward("draft", 1, 1)
        link.compute(float(i))  # step i takes i seconds
        for l in range(2):
            orch.on_draft_experts(l, torch.tensor([[8 + i]]))
        orch.draft_step(i, 4)
    assert link.reads == 0
    assert seen == [1.0, 2.0, 3.0]  # the fourth: once the device is past its end
