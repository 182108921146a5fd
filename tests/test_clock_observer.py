"""The clock observer (specter/clock/observer.py): one object each engine, draft and runtime
reports its compute to, priced on the virtual clock and a no-op on real clocks."""

from __future__ import annotations

import pytest
import torch

from specter.clock.costmodel import CostModel, HardwareProfile, charged_sizes
from specter.clock.observer import NULL_CLOCK, ComputeClock, runtime_clock
from specter.clock.timing import Timing
from specter.config import ModelConfig
from specter.clock.timing import make_link
from specter.offload.link import LinkProfile
from specter.placement.loader import load_model

CPU = torch.device("cpu")
HW = HardwareProfile(name="t", matrix_flops=312e12, mem_bandwidth_Bps=1.555e12,
                     launch_overhead_s=5e-6, h2d_bandwidth_Bps=31.5e9, h2d_latency_s=1e-5)


@pytest.fixture(scope="module")
def lm():
    return load_model(ModelConfig(name="tiny_deepseek", source="project"), CPU, progress=False)


def _virtual(lm):
    cost = CostModel(HW, charged_sizes(lm.model, "own", 4))
    return make_link("virtual", LinkProfile(31.5e9, 1e-5), CPU), cost


def test_runtime_steps_are_priced_by_the_cost_model(lm):
    """The runtime's own steps cost exactly the cost model's seconds, in the order told."""
    link, cost = _virtual(lm)
    clock = runtime_clock(link, cost)
    t0 = link.now()
    clock.router(5)
    clock.offload_layer(5)
    clock.expert(3)
    clock.grouped_experts([3, 2])
    want = (cost.router_s(5) + cost.offload_layer_s(5) + cost.expert_s(3)
            + cost.grouped_experts_s([3, 2]))
    assert link.now() - t0 == pytest.approx(want)


def test_real_clocks_observe_nothing(lm):
    """Without a cost model (a real clock) the runtime's clock is the no-op one, and a wall
    clock's observer installs no hook on the model."""
    link, _ = _virtual(lm)
    assert runtime_clock(link, None) is NULL_CLOCK
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in lm.model.modules())
    observer = Timing.wall(CPU).observer(lm.model, charge_experts=True)
    after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in lm.model.modules())
    assert observer is NULL_CLOCK and after == before
    with observer.captured_step():
        observer.compiled_step()  # no-ops


def test_a_compiled_step_is_charged_as_its_hooks_would(lm):
    """`compiled_step` charges what the forward hooks charge for the same eager forward of one
    position (they do not run inside a compiled region), plus one launch in `captured_step`."""
    from specter.decoding.batch import forward_logits, new_cache

    link, cost = _virtual(lm)
    clock = ComputeClock(link, cost, lm.model, charge_experts=False)
    try:
        cache = new_cache(lm.model)
        with torch.no_grad():
            clock.begin_forward(4, 4)
            forward_logits(lm.model, torch.tensor([[1, 2, 3, 4]]), cache)
            clock.begin_forward(1, 5)
            t0 = link.now()
            forward_logits(lm.model, torch.tensor([[5]]), cache)
        eager = link.now() - t0
        assert eager > 0
        t1 = link.now()
        clock.compiled_step()
        assert link.now() - t1 == pytest.approx(eager)
        t2 = link.now()
        with clock.captured_step():
            pass
        assert link.now() - t2 == pytest.approx(HW.launch_overhead_s)
    finally:
        clock.remove()
