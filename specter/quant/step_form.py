"""How the INT4 draft's step runs, answered in one function: `draft_step_form`.

A draft step runs in one of three forms: eager (one kernel after another, as the model's
forward issues them), compiled (one graph over a static cache, `spec.compile`:
decoding/compiled_draft.py `StaticKV`; on CUDA the whole step captured as one CUDA graph and
replayed per step), or eager with each draft layer replayed as its own CUDA graph
(`quant.graphs`: quant/kernels.py `GraphedExperts`). The question is asked three times, with
more known each time, and answered here each time:
- before the draft's backend is chosen (`backend=None`): whether the step is to compile, so
  that `quant.backend=auto` takes a backend that compiles (quant/build.py `resolve_backend`);
- once the backend is known (quant/build.py `int4_experts_for`): whether the draft layers are
  graphed (not where the whole step is captured);
- when the engine is built (decoding/compiled_draft.py `compiled_mode`, with `copied_kv`: a
  second instance reading a per-window copy of the target's KV, which stays eager): whether
  the step compiles, and why (the record's `draft_compile`).
`on` where the form cannot run is refused in one sentence; every fallback of `auto` is said.
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.errors import UserError
from specter.quant.kernels import COMPILES, FIXED_SHAPE

GRAPHS = ("auto", "on", "off")
# what a compiled draft step is on CUDA (the record's `draft_compile`)
CAPTURED = "the whole draft step captured as one CUDA graph, replayed per step"
COPIED_KV_EAGER = "eager: a per-window copy of the target's KV (system.kv_copy) stays eager"
GRAPHS_AND_STEP = ("quant.graphs=on replays each draft layer as its own CUDA graph and "
                   "spec.compile=on captures the whole draft step as one: choose one "
                   "(quant.graphs=off, or spec.compile=off).")


@dataclass(frozen=True)
class DraftStepForm:
    """The answer: `compiled` (one graph over a static cache; on CUDA captured as one CUDA
    graph: `captured`) and why; `layer_graphs`, each draft layer replayed as its own CUDA
    graph, and why (None before the backend is known)."""

    compiled: bool
    why: str
    captured: bool = False
    layer_graphs: bool = False
    graphs_why: str | None = None


def counted_clock(hw) -> bool:
    """Whether the hardware settings are a counted profile's virtual clock
    (specter/clock/counted.py: host costs charged from what the code issues)."""
    return hw.kind.charged and (getattr(hw, "host_op_s", 0) > 0
                                or getattr(hw, "sync_s", 0) > 0)


def settle_compile(knob: str, setting: str, what: str, reasons: list[str]) -> tuple[bool, str]:
    """(compiled, why) for a compile knob (`spec.compile`, resident's `system.compile`):
    `off` stays eager; with no `reasons` against it, compiled; else `on` refuses in one
    sentence naming `what` and the reasons, and `auto` stays eager and says why. On CUDA a
    compiled step is captured as one CUDA graph (`quant.kernels.capture_graph`), the draft's
    and resident's alike."""
    if setting == "off":  # (one of config.COMPILE_MODES: checked where the setting is read)
        return False, f"{knob}=off"
    if not reasons:
        return True, f"{knob}={setting}"
    if setting == "on":
        raise UserError(f"{knob}=on cannot compile {what}: " + "; ".join(reasons) + ".")
    return False, "eager: " + "; ".join(reasons)


def draft_step_form(job, backend: str | None = None, copied_kv: bool = False) -> DraftStepForm:
    """How `job`'s INT4 draft step runs (`job.draft`: spec.compile, quant.graphs; its rows,
    temperature, device and clock), given its `backend` once chosen and whether the draft
    reads a per-window copy of the target's KV (`copied_kv`).

    Before the backend (`backend=None`), the step is to compile where `spec.compile=on`; or
    under `auto` with one greedy row on a real clock (on the CPU, where the compiled step was
    measured faster; on CUDA, where the whole step is captured as one CUDA graph, unless
    quant.graphs=on asked for each layer's own graph), and on a counted profile's virtual
    clock (it charges what the engine issues on the GPU it models, where the step is
    captured). On other virtual clocks `auto` keeps the eager default backend, as the paper's
    systems run: the modelled step's time does not depend on the backend, and each run would
    pay a compilation.

    With the backend: `auto` compiles where the step has static shapes (one row, greedy, a
    backend whose draft experts have no data-dependent shape: `gather_int4`, `fused_int4`),
    not beside quant.graphs=on, not over a copied KV; on CUDA the compiled step is captured.
    The draft layers are graphed on CUDA with a fixed-shape backend (kernels.FIXED_SHAPE)
    under `on`, and under `auto` unless the whole step is captured."""
    spec, device = job.draft, job.device
    graphs, cuda = spec.quant.graphs, device.type == "cuda"
    if graphs not in GRAPHS:
        raise UserError(f"unknown quant.graphs '{graphs}'; choose one of: {', '.join(GRAPHS)}.")
    if graphs == "on" and spec.compile == "on":
        raise UserError(GRAPHS_AND_STEP)
    if backend is None:
        return DraftStepForm(*_before_backend(job))
    # the step: compiled where nothing stands against it
    reasons = []
    if job.rows != 1:
        reasons.append(f"a batch of {job.rows} rows drafts with holes (a static step is one row)")
    if backend == "triton":
        reasons.append("the triton backend's kernel is replayed per layer as a CUDA graph "
                       "(quant.graphs), not traced into one step (quant.backend=fused_int4 "
                       "compiles)")
    elif backend not in COMPILES:
        reasons.append(f"the {backend} backend reads the routing on the host "
                       "(quant.backend=fused_int4 compiles)")
    if job.temperature > 0:
        reasons.append("speculative sampling picks on the host")
    on, why = settle_compile("spec.compile", spec.compile, "the draft step", reasons)
    if on and graphs == "on" and cuda and backend in FIXED_SHAPE:  # the layers' graphs instead
        on, why = False, ("eager: quant.graphs=on replays each draft layer as its own CUDA "
                          "graph (spec.compile=auto leaves the step to it)")
    stays_eager = on and copied_kv
    if stays_eager:
        if spec.compile == "on":
            raise UserError(f"spec.compile=on cannot compile this draft step: {COPIED_KV_EAGER}.")
        on, why = False, COPIED_KV_EAGER
    elif on and cuda:
        why = f"{why}: {CAPTURED}"
    # the layers: graphed where they can be and the whole step is not captured
    layer_graphs, graphs_why = _layer_graphs(graphs, backend, device, whole_step=on and cuda)
    if stays_eager and layer_graphs:
        graphs_why = f"{graphs_why} (the step stays eager)"
    return DraftStepForm(on, why, on and cuda, layer_graphs, graphs_why)


def _before_backend(job) -> tuple[bool, str]:
    mode, hw, device = job.draft.compile, job.clock.hardware, job.device
    if mode == "on":
        return True, "spec.compile=on"
    if mode != "auto" or job.rows != 1 or job.temperature != 0:
        return False, "eager: spec.compile, a batch or sampling"
    if counted_clock(hw):
        return True, "auto: a counted profile charges the GPU's engine, whose step is captured"
    if not hw.kind.real:
        return False, "auto: a virtual clock keeps the eager default backend"
    if device.type == "cuda":
        return job.draft.quant.graphs != "on", "auto: CUDA captures the whole step"
    return device.type == "cpu", "auto: the CPU's compiled step is faster"


def _layer_graphs(name: str, backend: str, device, whole_step: bool) -> tuple[bool, str]:
    """(replay draft layers as CUDA graphs, why)."""
    if name == "off":
        return False, "quant.graphs=off"
    if device.type != "cuda":
        if name == "on":
            raise UserError(f"quant.graphs=on replays CUDA graphs, and this run is on {device}; "
                            "use quant.graphs=auto or off.")
        return False, f"auto: {device.type}, not CUDA"
    if backend not in FIXED_SHAPE:
        if name == "on":
            raise UserError(f"quant.graphs=on needs a fixed-shape draft backend "
                            f"({', '.join(FIXED_SHAPE)}); quant.backend resolved to {backend}.")
        return False, f"auto: {backend} issues kernels per routed expert"
    if whole_step and name == "auto":
        return False, "auto: the whole draft step is captured as one CUDA graph (spec.compile)"
    return True, "quant.graphs=on" if name == "on" else f"auto: CUDA and {backend}"
