"""Host-computed misses (`system.host_compute`, `lru_hybrid`, `specter_hybrid`): lossless on
every tiny architecture (the host computes the same arithmetic as the device when both are
the CPU), the per-miss decision against hand arithmetic, the host's own timeline (modelled on
the virtual clock, a host thread on real and emulated ones), and the refusals."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import TINY
from specter.compose import job_of
from specter.recipes import build_engine
from specter.budget import resolve_slots
from specter.config import RunConfig
from specter.errors import UserError
from specter.models import archs
from specter.placement.loader import load_model
from steering import exact_draft_layers
from test_batch import A100, CPU, prompts

SLOW = dict(A100, h2d_bandwidth_Bps=0.5e9)  # copies dear against the host: misses go there


def engine_for(name: str, system: str, hardware=SLOW, device=CPU, dtype="float32", spec=None,
               quant=None, **system_kw):
    cfg = RunConfig.from_dict({
        "model": {"name": name, "source": "project", "dtype": dtype,
                  "stands_for": archs.STANDS_FOR[archs.parse_name(name)[1]]},
        "budget": {"name": "low"}, "system": {"name": system, **system_kw},
        "dataset": {"name": "gsm8k"}, "hardware": hardware, "workload": {},
        "spec": spec or {"k": 4}, "quant": quant or {}, "progress": False})
    lm = load_model(cfg.model, device, progress=False)
    budget = dataclasses.replace(resolve_slots(cfg.budget, cfg.model, lm.spec.num_experts,
                                               lm.spec.top_k), staging=0)
    return build_engine(job_of(cfg, lm, budget, device)), lm


@pytest.mark.parametrize("name", TINY)
def test_hybrid_systems_are_lossless_and_use_the_host(name):
    resident, lm = engine_for(name, "resident")
    batch = prompts(lm.tokenizer, 3)
    ref = [g.tokens for g in resident.generate_batch(batch, 16)]
    for system in ("lru_hybrid", "specter_hybrid"):
        engine, _ = engine_for(name, system)
        assert engine.runtime.host_compute
        engine.reset()
        gens = engine.generate_batch(batch, 16)
        assert [g.tokens for g in gens] == ref, system
        if system == "lru_hybrid":
            assert gens[0].stats["host_experts"] > 0 and 0 < gens[0].stats["host_frac"] <= 1


# a counted profile's virtual clock: spec.compile=auto compiles the draft step of a one-row
# job there, as on a CUDA wall clock (quant.build.draft_compiles)
COUNTED = dict(SLOW, host_op_s=2e-5, launch_overhead_s=0.0)


@pytest.mark.parametrize("system", ["specter_hybrid", "specmoeoff"])
def test_a_job_for_one_row_whose_draft_step_compiles_decodes_a_batch(system):
    """The CUDA test below on the CPU: a job built for one row (workload.batch=1) whose draft
    step compiles (`StaticKV`, one row; the second instance's own static cache for
    specmoeoff) is handed three prompts: the batch drafts in the eager layout, lossless, the
    record says so; a one-row request afterwards still drafts in the compiled step."""
    from specter.decoding.compiled_draft import StaticKV

    resident, lm = engine_for("tiny_deepseek", "resident")
    batch = prompts(lm.tokenizer, 3)
    ref = [g.tokens for g in resident.generate_batch(batch, 16)]
    engine, _ = engine_for("tiny_deepseek", system, hardware=COUNTED,
                           spec={"k": 4, "compile_backend": "eager"})
    assert isinstance(engine.draft.layout, StaticKV)
    engine.reset()
    gens = engine.generate_batch(batch, 16)
    assert [g.tokens for g in gens] == ref
    stats = gens[0].stats
    assert not stats["draft_compiled"] and not stats["draft_captured"]
    assert "batch of 3 rows" in stats["draft_compile"] and stats["draft_compiles"] == 0
    engine.reset()
    one = engine.generate_batch(batch[:1], 16)[0]
    assert one.tokens == ref[0]
    assert one.stats["draft_compiled"] and one.stats["draft_compiles"] == 1
    assert one.stats["draft_kv"] == ("static" if system == "specter_hybrid" else "own")


def test_host_compute_is_a_switch_on_either_name():
    off, _ = engine_for("tiny_qwen", "specter_hybrid", host_compute=False)
    on, _ = engine_for("tiny_qwen", "lru", host_compute=True)
    assert not off.runtime.host_compute and on.runtime.host_compute
    plain, _ = engine_for("tiny_qwen", "specter")
    assert not plain.runtime.host_compute


def test_the_decision_against_hand_arithmetic():
    """A miss goes to the host when its host job (queued after the host's earlier jobs) ends
    before its copy (queued after the copy engine's) lands and computes."""
    engine, _ = engine_for("tiny_qwen", "lru_hybrid")
    rt = engine.runtime
    cost = rt.cost
    copy_s = cost.transfer_s(cost.expert_transfer_bytes())
    tokens = {3: 1, 5: 40}
    host_1 = cost.host_expert_job_s(1)
    assert host_1 < copy_s + cost.expert_s(1)  # one token: the host wins on a slow link
    chosen = rt.host.decide([3, 5], tokens)
    # expert 5 after expert 3 on the host, against its copy alone on the link
    expect_5 = host_1 + cost.host_expert_job_s(40) < copy_s + cost.expert_s(40)
    assert chosen == ([3, 5] if expect_5 else [3])
    # A prefetched expert still in flight: the host takes it only if its copy lands too late.
    now = rt.link.now()
    assert rt.host.decide([], {7: 1}, {7: now + 1.0}) == [7]
    assert rt.host.decide([], {7: 1}, {7: now}) == []
    t0 = rt.link.now()
    job = rt.link.host(lambda: "value", 0.01)
    rt.link.compute(0.004)
    assert rt.link.wait_host(job) == "value"
    assert rt.link.now() - t0 == pytest.approx(0.01)  # the device waited 6 ms for the host
    assert rt.link.host_wait_s == pytest.approx(0.006)


def test_the_emulated_clock_runs_host_jobs_on_their_own_thread_and_stays_lossless():
    """Real time on this CPU: the host's jobs run on a host thread beside the decoding thread
    (the path a GPU run takes), each held to its modelled seconds scaled to this machine."""
    resident, lm = engine_for("tiny_qwen", "resident")
    batch = prompts(lm.tokenizer, 2)
    ref = [g.tokens for g in resident.generate_batch(batch, 12)]
    engine, _ = engine_for("tiny_qwen", "lru_hybrid", hardware=dict(SLOW, clock="emulated"))
    rt = engine.runtime
    assert rt.link.kind == "wall" and rt.link.time_scale > 0 and rt.rates is rt.cost
    engine.reset()
    gens = engine.generate_batch(batch, 12)
    assert [g.tokens for g in gens] == ref
    stats = gens[0].stats
    assert stats["host_experts"] > 0 and stats["host_busy_ms"] > 0
    assert rt.link._host is not None and rt.link._host._thread.is_alive()
    rt.link.close()
    assert rt.link._host is None


def test_a_real_link_host_job_reports_its_value_error_and_wait():
    from specter.clock.timing import make_link
    from specter.offload.link import LinkProfile

    link = make_link("wall", LinkProfile(bandwidth_Bps=1e9, latency_s=0.0), CPU,
                     time_scale=2.0)  # a job held to 2 x its modelled 10 ms
    try:
        job = link.host(lambda: 41 + 1, 0.01)
        assert link.host_free() > link.now()  # its estimate is still queued
        assert link.wait_host(job) == 42
        assert job.end - job.start >= 0.02 and link.host_wait_s > 0 and link.host_busy_s >= 0.02
        bad = link.host(lambda: 1 / 0, 0.0)
        with pytest.raises(RuntimeError, match="host expert job failed"):
            link.wait_host(bad)
    finally:
        link.close()


def test_without_rates_it_is_refused_in_one_sentence():
    with pytest.raises(UserError, match="modelled link"):  # the CPU's wall clock cannot offload
        engine_for("tiny_qwen", "lru_hybrid", hardware={"name": "cpu", "device": "cpu"})


def test_a_profile_without_host_rates_is_refused():
    bare = {k: v for k, v in SLOW.items() if not k.startswith("host_")}
    with pytest.raises(UserError, match="host's rates"):
        engine_for("tiny_qwen", "lru_hybrid", hardware=bare)


def test_host_profiles_override_the_hardware_host_and_survive_the_cpu_fallback():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import REPO
    from specter.compose import resolve_auto_hardware

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        plain = compose(config_name="config", overrides=["hardware=a100_pcie4_hf"])
        chosen = compose(config_name="config", overrides=["hardware=a100_pcie4_hf", "host=assumed"])
        auto = compose(config_name="config", overrides=["host=measured"])
    assert plain.hardware.host == "epyc7742_2s" and plain.hardware.host_matrix_flops == 9.2e12
    assert chosen.hardware.host == "assumed" and chosen.hardware.host_mem_bandwidth_Bps == 1e11
    cfg = RunConfig.from_dict(OmegaConf.to_container(auto, resolve=True))
    fell_back = resolve_auto_hardware(cfg, CPU, log=lambda *_: None)
    assert fell_back.hardware.name == "a100_pcie4_hf" and fell_back.hardware.host == "measured"
    assert fell_back.hardware.host_matrix_flops == auto.hardware.host_matrix_flops


def test_host_rate_measures_this_machine():
    from experiments import host_rate

    m = host_rate.measure(repeats=1, tokens=16)
    assert m["host_matrix_flops"] > 1e8 and m["host_mem_bandwidth_Bps"] > 1e8
    text = host_rate.as_yaml(m)
    assert text.startswith("# @package hardware") and "host: measured" in text


def test_a_real_clock_without_a_profile_is_refused_in_one_sentence():
    from specter.offload.build import check_host_rates

    with pytest.raises(UserError, match="cuda clock has no profile for.*h200_measured"):
        check_host_rates(None, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("system", ["lru_hybrid", "specter_hybrid"])
def test_host_compute_on_cuda_runs_on_the_host_thread_beside_the_gpu(system):
    """Real CUDA time (the profile's rates decide only): misses go to the host thread, which
    computes in fp32 from the pinned host copy while the GPU goes on. The device and the
    host round differently, so tokens may differ from resident's: counted, and bounded."""
    import torch

    dev = torch.device("cuda")
    wall = dict(SLOW, clock="wall", device="cuda")
    resident, lm = engine_for("tiny_deepseek", "resident", hardware=wall, device=dev)
    batch = prompts(lm.tokenizer, 3)
    ref = [g.tokens for g in resident.generate_batch(batch, 16)]
    # an RTN draft: GPTQ's calibration was most of this test's time, and the draft only
    # proposes (the job is built for one row: its draft step would compile; the batch of
    # three drafts eagerly, test_a_job_for_one_row_whose_draft_step_compiles_decodes_a_batch)
    engine, _ = engine_for("tiny_deepseek", system, hardware=wall, device=dev,
                           quant={"method": "rtn"})
    assert engine.timing.clock == "cuda" and engine.runtime.rates is not None
    engine.reset()
    gens = engine.generate_batch(batch, 16)
    differ = sum(a != b for g, r in zip(gens, ref) for a, b in zip(g.tokens, r))
    total = sum(len(r) for r in ref)
    print(f"{system} on cuda: {differ} of {total} tokens differ from resident")
    assert gens[0].stats["host_experts"] > 0 and gens[0].stats["host_busy_ms"] > 0
    assert differ <= total // 4


def test_converted_host_copies_are_made_ahead_by_the_lookahead_and_keep_the_arithmetic():
    """Beside a GPU the host computes from converted (fp32) copies. Forced here on the CPU with
    float64 copies: specter_hybrid's plans convert the predicted experts they could not load
    on the host thread during the draft, verification's host jobs find them converted, and
    the tokens equal those of the same run converting on demand (no lookahead)."""
    import torch

    from specter.offload.host import HostWeights

    def run(lookahead: bool):
        engine, lm = engine_for("tiny_deepseek", "specter_hybrid", hardware=dict(SLOW, clock="emulated"))
        rt = engine.runtime
        rt.host.weights = HostWeights(rt.cache.store, torch.float64, capacity=64)
        # a draft that routes as verification will: its predictions are the experts the host
        # is then asked for, whatever the trained weights
        engine.draft.draft_mode.draft_layers = exact_draft_layers(lm.model, rt.cache.store)
        if not lookahead:
            rt.host.prepare = lambda l, experts: 0
        engine.reset()
        gens = engine.generate_batch(prompts(lm.tokenizer, 2), 12)
        rt.link.close()
        return [g.tokens for g in gens], gens[0].stats

    ahead, stats = run(True)
    assert stats["host_prepares"] > 0 and stats["host_ready_hits"] > 0 and stats["host_experts"] > 0
    on_demand, plain = run(False)
    assert plain["host_prepares"] == 0
    assert ahead == on_demand


def test_a_real_link_estimates_its_copy_queue_and_forgets_finished_copies():
    import torch

    from specter.clock.timing import make_link
    from specter.offload.link import LinkProfile

    link = make_link("wall", LinkProfile(bandwidth_Bps=1e6, latency_s=0.0), CPU)
    try:
        src, dst = torch.zeros(50_000), torch.empty(50_000)  # 200 kB: 200 ms at 1 MB/s
        t0 = link.now()
        t = link.copy(dst, src)
        free = link.copy_engine_free()
        assert t0 + 0.1 < free <= link.now() + 0.2  # the profile's time for the bytes not landed
        link.wait(t)
        assert link.copy_engine_free() - link.now() <= 1e-3 and not link._pending
        small = torch.zeros(10), torch.empty(10)
        for _ in range(3):
            link.wait(link.copy(small[1], small[0]))
        assert len(link._pending) <= 1  # finished copies are dropped as new ones are issued
    finally:
        link.close()


def test_a_dropped_real_link_stops_its_host_thread():
    import gc

    from specter.clock.timing import make_link
    from specter.offload.link import LinkProfile

    link = make_link("wall", LinkProfile(bandwidth_Bps=1e9, latency_s=0.0), CPU)
    link.wait_host(link.host(lambda: None, 0.0))
    thread = link._host._thread
    assert thread.is_alive() and link.host_busy_s >= 0
    del link
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()  # sweeps build many engines and close none of their links
