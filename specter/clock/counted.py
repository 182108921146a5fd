"""A counted hardware profile: the host's cost of decoding charged from what the code issues.

The `*_hf` profiles and `h200_measured` charge an eager engine's host work as constants: per
decoder layer, per MLP call, per fused draft layer, per offloaded MoE layer, each fit on the
code of its day. They cannot see a change to the hot path. A counted profile (`host_op_s` or
`sync_s` set, every one of those constants 0) charges instead, while the run decodes on the
virtual clock, each launching operation the code dispatches (specter/counting.py: not views,
plus Triton launches and graph replays) at `host_op_s`, and each host sync, host read of a
device tensor or blocking upload at `sync_s`. Host-side bookkeeping (`counting.host_side()`:
the batch cache's mask, a few operations per forward for every system alike) and the clock's
own pricing (`counting.charging_only()`) are not charged: the rates were fit on counts of
the same kinds.

Real sizes: an operation inside a modelled decoder layer stands for those of the real layers
that layer stands for, as the cost model's compute does (attention and norms by
`attn_multiplier`, the MoE block by `moe_multiplier`, a dense MLP by `dense_multiplier`);
operations outside the layers (embedding, lm head, sampling, the engine's bookkeeping) count
once.

The host's time is added to the device's (one timeline). A GPU overlaps them between syncs,
so where the device's own work is long (large models) this over-charges; in the host-bound
regime of the eager code it is the right first model. The H200 records of 2026-11-30 check
it (docs/measurements/counted-2026-12-01/README.md).
"""

from __future__ import annotations

import contextlib
from collections import Counter

from torch import nn

from specter.counting import OpCounter
from specter.models.introspect import experts_modules
from specter.clock.costmodel import CostModel
from specter.offload.link import Link


class ChargingCounter(OpCounter):
    """Counts like `OpCounter` and charges each launching operation and each sync to the link's
    clock at the profile's rates, scaled by the real layers the current module stands for."""

    def __init__(self, link: Link, cost: CostModel, cpu_run: bool = True):
        super().__init__(cpu_run)
        self.link, self.hw, self.sizes = link, cost.hw, cost.sizes
        self.scale = 1.0
        self.charged_s = 0.0
        self.forwards: Counter = Counter()  # forwards per phase (`follow_phases`)

    def count(self, kind: str) -> None:
        super().count(kind)
        if kind in ("launching", "launched"):  # the host's issue hides the kernel's floor
            seconds = max(self.hw.host_op_s, self.hw.kernel_floor_s) * self.scale
        elif kind == "graph":  # a graph replay: one launch (its kernels: `captured_step`)
            seconds = self.hw.host_op_s * self.scale
        elif kind in ("sync", "host_read"):
            seconds = self.hw.sync_s * self.scale
        else:
            return
        if seconds:
            self.link.compute(seconds)
            self.charged_s += seconds

    def as_record(self) -> dict:
        """The batch's counted host work (every phase, prefill included) and its charge; the
        launching operations of one verification forward (a window's) and, where the draft
        ran eagerly, of one draft step (`kernels.*`: a GPU runs one kernel for each; a
        captured draft step's kernels are the draft's record, draft.py)."""
        total = sum(self.counts.values(), Counter())
        rec = {"counted.launching": total["launching"], "counted.syncs": total["syncs"],
               "counted.host_reads": total["host_reads"], "counted.host_ms": self.charged_s * 1e3}
        rec.update(phase_kernels(self.counts, self.forwards))
        return rec

    def scaled_by(self, models: list[nn.Module]) -> list:
        """Hooks setting `scale` inside each decoder layer of `models` (returned handles)."""
        s = self.sizes
        handles = []

        def enter(scale):
            def hook(*_):
                saved.append(self.scale)
                self.scale = scale
            return hook

        def leave(*_):
            self.scale = saved.pop()

        saved: list[float] = []
        for model in models:
            moe_ids = {id(m) for _, m in experts_modules(model)}
            for layer in model.model.layers:
                moe = any(id(m) in moe_ids for m in layer.mlp.modules())
                for module, scale in ((layer, s.attn_multiplier),
                                      (layer.mlp, s.moe_multiplier if moe else s.dense_multiplier)):
                    handles.append(module.register_forward_pre_hook(enter(scale)))
                    handles.append(module.register_forward_hook(leave))
        return handles


def engine_models(engine) -> list[nn.Module]:
    """The models whose forwards the engine runs: the target, and a separate draft's."""
    models = [engine.model]
    layout = getattr(getattr(engine, "draft", None), "layout", None)
    if layout is not None and layout.model is not engine.model:
        models.append(layout.model)
    return models


@contextlib.contextmanager
def counted_host_costs(engine):
    """Around one decode call: on a counted profile's virtual clock, charge what the engine
    issues (yields the counter, or None where the profile is not counted)."""
    timing = getattr(engine, "timing", None)
    cost = getattr(timing, "cost", None)
    if not timing.charged or not cost.hw.counted:
        yield None
        return
    counter = ChargingCounter(timing.link, cost, cpu_run=engine.device.type == "cpu")
    handles = counter.scaled_by(engine_models(engine))
    try:
        with follow_phases(counter, engine) as counter.forwards, counter:
            yield counter
    finally:
        for h in handles:
            h.remove()


def phase_kernels(counts: dict, forwards: Counter) -> dict:
    """Launching operations per verification forward (`kernels.verify_window`) and per eager
    draft step (`kernels.draft_step`, only where no draft step was a graph replay)."""
    rec = {}
    verify, draft = counts.get("verify", Counter()), counts.get("draft", Counter())
    if forwards.get("verify"):
        rec["kernels.verify_window"] = verify["launching"] / forwards["verify"]
    if forwards.get("draft") and not draft["graph_replays"]:
        rec["kernels.draft_step"] = draft["launching"] / forwards["draft"]
    return rec


@contextlib.contextmanager
def follow_phases(counter, engine):
    """While inside: `counter.phase` is the phase of the forward the engine runs ("prefill",
    "decode", "draft", "verify"; "bookkeeping" between forwards). Yields the forwards run per
    phase (a Counter)."""
    forwards: Counter = Counter()
    events = getattr(engine, "events", None)  # the loop's events (decoding/loop.py `Events`)
    follower = _PhaseFollower(counter, forwards)
    if events is not None:
        events.observers.insert(0, follower)  # the phase set before the others hear it
    hooks = [m.register_forward_hook(lambda *_: setattr(counter, "phase", "bookkeeping"))
             for m in engine_models(engine)]
    counter.phase = "bookkeeping"
    try:
        yield forwards
    finally:
        for h in hooks:
            h.remove()
        if events is not None:
            events.observers.remove(follower)


class _PhaseFollower:
    """An observer of the loop's forwards: the counter's phase, and the forwards per phase."""

    def __init__(self, counter, forwards: Counter):
        self.counter, self.forwards = counter, forwards

    def forward(self, phase: str, tokens: int, context: int, rows: int = 1) -> None:
        self.counter.phase = phase
        self.forwards[phase] += 1
