"""Issue 45 item 6: one engine for every offloading system, so a ratio measures the policy.

Every system the registry knows is built as a GPU run builds it (the CUDA link's code over the
stand-in, tests/fake_cuda.py: clock "cuda"), with the backend whose draft step compiles. The
offloading ones must verify (or decode) through the same `OffloadRuntime` and the same
fixed-launch kernel, and every system with an INT4 draft on the device must take the same
draft-step decision (`compiled_mode`: compiled, and on CUDA captured as one graph). Resident's
decode step compiles too (on CUDA: captured the same way, tests/test_compiled_decode.py). The
systems outside the shared engine are named, each with the reason its design gives.
"""

from __future__ import annotations

import pytest
import torch

from fake_cuda import FakeCuda
from specter.compose import job_of
from specter.recipes import SYSTEMS, build_engine
from specter.budget import resolve_slots
from specter.config import RunConfig
from specter.decoding import engines
from specter.decoding.engines import GreedyEngine, SpeculativeEngine
from specter.clock.timing import Timing
from specter.offload.link import CudaLink, LinkProfile
from specter.offload.runtime import OffloadRuntime
from specter.placement.loader import load_model

CPU = torch.device("cpu")
HW = {"name": "cuda", "device": "cpu", "clock": "virtual", "charge": "own",
      "matrix_flops": 312e12, "mem_bandwidth_Bps": 1.555e12, "launch_overhead_s": 5e-6,
      "h2d_bandwidth_Bps": 31.5e9, "h2d_latency_s": 10e-6,
      "host_matrix_flops": 2e12, "host_mem_bandwidth_Bps": 100e9}
# systems whose design is another engine: what they reproduce is that engine
OUTSIDE = {
    "transformers": "accelerate's offload hooks, the path Transformers users run",
    "vllm_offload": "vLLM's cpu_offload_gb, modelled on a virtual clock only",
    "fidelity": "a measurement of draft against target routing, not a decoder",
}
HOST_DRAFT = {"specmoe": "SpecMoE drafts on the host (its design), not with an INT4 copy"}
pytestmark = pytest.mark.filterwarnings("ignore:cuda link. src is pageable")  # CPU tensors


def _build(system: str, monkeypatch):
    cfg = RunConfig.from_dict({
        "model": {"name": "tiny_deepseek", "source": "project", "stands_for": "deepseek"},
        "budget": {"name": "low"}, "system": {"name": system}, "dataset": {"name": "gsm8k"},
        "hardware": HW, "quant": {"backend": "gather_int4"}, "workload": {},
        "spec": {"k": 3}, "progress": False})
    modelled = engines.timing_for
    monkeypatch.setattr(engines, "timing_for", lambda ctx: Timing(
        link=CudaLink(LinkProfile(31.5e9, 1e-5), CPU, cuda=FakeCuda()), cost=None,
        clock="cuda", rates=modelled(ctx).cost))
    loaded = load_model(cfg.model, CPU, progress=False)
    budget = resolve_slots(cfg.budget, cfg.model, loaded.spec.num_experts, loaded.spec.top_k)
    return build_engine(job_of(cfg, loaded, budget, CPU))


def test_every_offloading_system_runs_on_the_same_engine(monkeypatch):
    kernels, steps, kinds = {}, {}, {}
    for system in SYSTEMS:
        if system in OUTSIDE:
            continue
        with monkeypatch.context() as m:
            engine = _build(system, m)
        kinds[system] = type(engine)
        assert isinstance(engine, (GreedyEngine, SpeculativeEngine)), system
        if system == "resident":
            assert engine.runtime is None and engine.compiled["decode_compiled"], engine.compiled
            continue
        assert isinstance(engine.runtime, OffloadRuntime), system
        kernels[system] = engine.runtime.kernel()
        if isinstance(engine, SpeculativeEngine) and system not in HOST_DRAFT:
            steps[system] = (engine.compiled["draft_compiled"], engine.compiled["draft_compile"])
    assert set(kernels.values()) == {"fused"}, kernels  # the CPU's choice, for every one
    assert set(steps.values()) == {(True, "spec.compile=auto")}, steps
    # the lists above are the registry's, less the named exceptions: a new system lands here
    assert set(kinds) == set(SYSTEMS) - set(OUTSIDE)
    assert {"lru", "lru_s", "mo_sm", "specmoeoff", "specter", "sp_e", "sp_l"} <= set(steps) | {
        s for s, k in kinds.items() if k is GreedyEngine}
