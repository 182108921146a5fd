"""What a CUDA run of the decode path would wait for, counted on the CPU.

The CUDA link's own code runs over a stand-in for `torch.cuda` (tests/fake_cuda.py) that logs
every host wait and every cross-stream wait. Per window of specter, specmoeoff and lru_s (and
per step of lru): no device-wide synchronize, no host wait on the copy stream, and the copy
stream made to wait only on the fences of the compute that read the slot it overwrites (an
event, never the whole compute stream). The tokens are still the resident model's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specter.compose import job_of
from specter.recipes import build_engine
from fake_cuda import FakeCuda
from specter.budget import resolve_slots
from specter.config import RunConfig
from specter.decoding import engines
from specter.models import archs
from specter.placement.loader import load_model
from specter.clock.timing import Timing
from specter.offload.link import CudaLink, LinkProfile

CPU = torch.device("cpu")
A100 = {"name": "a100_pcie4_ideal", "device": "cpu", "clock": "virtual", "charge": "own",
        "matrix_flops": 312e12, "mem_bandwidth_Bps": 1.555e12, "launch_overhead_s": 5e-6,
        "h2d_bandwidth_Bps": 31.5e9, "h2d_latency_s": 10e-6,
        "host_matrix_flops": 2e12, "host_mem_bandwidth_Bps": 100e9}
pytestmark = pytest.mark.filterwarnings("ignore:cuda link. src is pageable")  # CPU tensors
PROMPT = "Janet has 3 apples and buys 5 more. How many"


def _engine(system: str, monkeypatch, fake: FakeCuda | None, name: str = "tiny_deepseek",
            hardware=A100, **system_kw):
    cfg = RunConfig.from_dict({
        "model": {"name": name, "source": "project", "dtype": "float32",
                  "stands_for": archs.STANDS_FOR[archs.parse_name(name)[1]]},
        "budget": {"name": "low"}, "system": {"name": system, **system_kw},
        "dataset": {"name": "gsm8k"}, "hardware": hardware,
        "workload": {"stop_on_eos": False}, "spec": {"k": 4}, "progress": False})
    lm = load_model(cfg.model, CPU, progress=False)
    budget = dataclasses.replace(resolve_slots(cfg.budget, cfg.model, lm.spec.num_experts,
                                               lm.spec.top_k), staging=0)
    if fake is not None:  # the CUDA link's code, on the stand-in; the profile's rates decide
        link = CudaLink(LinkProfile(hardware["h2d_bandwidth_Bps"], hardware["h2d_latency_s"]),
                        CPU, cuda=fake)  # host-computed misses, as on a real clock
        modelled = engines.timing_for
        monkeypatch.setattr(engines, "timing_for", lambda ctx: Timing(
            link=link, cost=None, clock="cuda", rates=modelled(ctx).cost))
    return build_engine(job_of(cfg, lm, budget, CPU)), lm


def _counted_run(engine, prompt, fake, n_new: int):
    """Generate one request, snapshotting the log at each window's (or step's) end: returns
    the generation and the waits logged from the first window's start to the last's end."""
    ends = []
    if hasattr(engine, "window"):
        window_end = engine.window.window_end

        def counted_end():
            window_end()
            ends.append(fake.log.snapshot())
        engine.window.window_end = counted_end
        starts = []
        forward = engine.window.forward

        def counted_forward(phase, *shape):
            if phase != "prefill" and not starts:
                starts.append(fake.log.snapshot())
            forward(phase, *shape)
        engine.window.forward = counted_forward
    else:  # greedy: every decode step's forward, before the engine's observers hear it
        starts = []

        class Snapshots:
            def forward(self, phase, *shape):
                if phase == "decode":
                    (ends if starts else starts).append(fake.log.snapshot())
        engine.events.observers.insert(0, Snapshots())
    engine.reset()
    gen = engine.generate(prompt, n_new)
    assert starts and ends, "the request ran windows"
    return gen, ends[-1].since(starts[0]), len(ends)


SLOW_LINK = dict(A100, h2d_bandwidth_Bps=0.5e9)  # copies dear: misses go to the host


@pytest.mark.parametrize("system", ["specter", "specmoeoff", "lru_s", "lru", "specter_hybrid"])
def test_the_decode_path_waits_only_on_the_compute_stream(system, monkeypatch):
    hybrid = system.endswith("_hybrid")
    resident, lm = _engine("resident", monkeypatch, None)
    prompt = lm.tokenizer(PROMPT)["input_ids"]
    ref = resident.generate(prompt, 24).tokens
    fake = FakeCuda()
    engine, _ = _engine(system, monkeypatch, fake, hardware=SLOW_LINK if hybrid else A100)
    gen, waits, windows = _counted_run(engine, prompt, fake, 24)
    assert gen.tokens == ref  # the link's real code still moves the right bytes
    assert windows >= 3
    s = engine.runtime.as_record()
    assert s["demand_misses"] + s.get("prefetches", 0) > 0, "copies were issued"
    if hybrid:  # the host thread computed some misses; the device waited for it alone
        assert s["host_experts"] > 0
    assert waits.device_syncs == 0, f"{waits.device_syncs} device-wide syncs in {windows} windows"
    assert waits.host_waits_on("copy") == 0, "the host waited on the copy stream"
    copy_waits = [on for who, on in waits.stream_waits if who == "copy"]
    assert copy_waits, "copies into slots read before wait for their readers' fences"
    assert all(on == "compute" for on in copy_waits), copy_waits  # events, never ':all'
    # the whole request (reset and records included) never waits for the whole device
    assert fake.log.device_syncs == 0
    # commit times came from the compute stream's events, read after the request
    assert len(gen.commit_times_s) == len(gen.tokens)
    assert all(b >= a for a, b in zip(gen.commit_times_s, gen.commit_times_s[1:]))


def test_a_copy_waits_for_the_fence_of_its_slots_last_reader(monkeypatch):
    """The slot a copy overwrites was last read by compute that the copy must follow; the
    fence it waits on is recorded after that read and not after later compute."""
    fake = FakeCuda()
    engine, lm = _engine("lru", monkeypatch, fake)
    cache = engine.runtime.cache
    engine.reset()
    lc = cache.layers[0]
    fence_after_reset = lc.read_fence[0]
    assert fence_after_reset is not None and fence_after_reset.stream == "compute"
    engine.generate(lm.tokenizer(PROMPT)["input_ids"], 4)
    # every slot read since the reset has a fence of its own, recorded after its read
    assert not lc.reading
    assert all(f is not None and f.stream == "compute" for f in lc.read_fence)


@pytest.mark.cuda
@pytest.mark.parametrize("system", ["specter", "specmoeoff", "lru_s", "lru"])
def test_on_cuda_the_decode_path_waits_only_on_the_compute_stream(system, monkeypatch):
    """The same count on a GPU, with the real torch.cuda patched to log (fake_cuda.CountedCuda):
    the syncs a real CUDA run of each system makes per window, in the steady state. A first
    request warms the engine up, as the runner's untimed warm-up does: the draft step's
    capture as one CUDA graph (`torch.cuda.graph` synchronizes the device, once a run) and
    its compilation happen there; the counted request's windows may then hold none, so a
    sync made every window (or every request) still fails."""
    from fake_cuda import CountedCuda

    dev = torch.device("cuda")
    cfg = RunConfig.from_dict({
        "model": {"name": "tiny_deepseek", "source": "project", "dtype": "float32",
                  "stands_for": archs.STANDS_FOR["deepseek"]},
        "budget": {"name": "low"}, "system": {"name": system},
        "dataset": {"name": "gsm8k"}, "hardware": {"name": "cuda", "device": "cuda",
                                                   "clock": "wall"},
        "workload": {"stop_on_eos": False}, "spec": {"k": 4}, "quant": {"method": "rtn"},
        "progress": False})
    lm = load_model(cfg.model, dev, progress=False)
    budget = dataclasses.replace(resolve_slots(cfg.budget, cfg.model, lm.spec.num_experts,
                                               lm.spec.top_k), staging=0)
    engine = build_engine(job_of(cfg, lm, budget, dev))
    link = engine.timing.link
    assert link.kind == "cuda"
    names = {torch.cuda.current_stream(dev).cuda_stream: "compute",
             link._stream.cuda_stream: "copy"}
    prompt = lm.tokenizer(PROMPT)["input_ids"]
    with CountedCuda(names) as warm:  # the warm-up request: captures and compiles, once
        engine.reset()
        engine.generate(prompt, 24)
    print(f"{system}: warm-up request, device syncs {warm.log.device_syncs}; draft: "
          f"{engine.compiled.get('draft_compile', '-')}")
    with CountedCuda(names) as counted:
        gen, waits, windows = _counted_run(engine, prompt, counted, 24)
    print(f"{system}: {windows} windows, device syncs {waits.device_syncs} (the whole "
          f"request {counted.log.device_syncs}), host waits on the copy stream "
          f"{waits.host_waits_on('copy')}, copy-stream waits {waits.stream_waits}")
    assert windows >= 3
    assert waits.device_syncs == 0
    assert waits.host_waits_on("copy") == 0
    assert all(on == "compute" for who, on in waits.stream_waits if who == "copy")
