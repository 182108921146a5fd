"""The drafts a speculative engine can use, each one part with the same small interface.

- `SelfInt4Draft`: the target's own instance drafts with the INT4 copy of its routed experts
  (Specter's SIC, LRU-S, SP-E/SP-L): one model, one KV cache, the draft mode switched in.
- `SeparateInt4Draft`: a second instance of the same checkpoint whose routed experts are the
  INT4 copy only, with its own KV cache (SpecMoEOff) or a per-window copy of the target's
  (Specter's no-sharing ablation, the artifact's "SIC off").
- A draft that computes its experts elsewhere supplies the same interface (SpecMoE's host
  draft, baselines/specmoe.py).

Each part: `self_draft` (the target's `SelfDraft` whose draft mode the loop switches in; None
when the draft is a second model), `layout` (where and how it drafts: a `SeparateDraft`, a
`CopiedKVDraft` or a compiled `StaticDraft`; None: in the target's own cache),
`listen(fn, all_layers)` (fn(moe_layer, top_k_index [T, k]) told of every draft experts call:
the clock's charge, a window prefetcher; `all_layers(routes [L, T, k])` its form for a compiled
step's every layer at once), `device_bytes` (device memory beyond the target's own
parameters and expert slots), `before_forward(tokens, context, phase, rows)`, `reset()` and
`as_record()`.
"""

from __future__ import annotations


import torch

from specter.counting import charging_only, routed_counts
from specter.decoding.drafting import CopiedKVDraft, SeparateDraft
from specter.decoding.self_draft import SelfDraft
from specter.engine import cache_bytes
from specter.models.introspect import experts_modules
from specter.placement.loader import load_model
from specter.placement.plan import PlacementPlan
from specter.clock.observer import NULL_CLOCK, NullClock
from specter.clock.timing import Timing
from specter.offload.store import release_fused
from specter.quant.build import Draft


def charges_virtually(timing: Timing) -> bool:
    """Whether compute steps are charged by the cost model (the virtual clock)."""
    return timing.cost is not None and timing.clock == "virtual"


class DraftPart:
    """The interface above, with its no-op defaults: a draft subclasses it and sets
    `self_draft` or `layout`."""

    self_draft: SelfDraft | None = None
    timing: Timing | None = None
    target_model = None
    kv_copy_bytes = kv_copies = 0
    layout = None  # where and how it drafts (drafting.py, static_draft.py); None: SharedDraft
    device_bytes = 0

    def listen(self, fn, all_layers=None, in_graph: bool = False) -> None:
        self.self_draft.listen(fn, all_layers, in_graph)

    def before_forward(self, tokens: int, context: int, phase: str, rows: int = 1) -> None:
        pass

    def graph_layers(self, why: str) -> None:
        """Replay each draft layer as a CUDA graph from now on (`GraphedExperts`, as
        quant.graphs=on builds them): where quant.graphs=auto was off for a step to be
        captured whole and the step stays eager after all; `why` goes to the record."""
        from specter.quant.kernels import GraphedExperts

        instance = self.self_draft or getattr(self, "instance", None)
        instance.draft_layers = [layer if isinstance(layer, GraphedExperts)
                                 else GraphedExperts(layer) for layer in instance.draft_layers]
        self.draft.graphs, self.draft.graphs_choice = True, why

    def warm_graphs(self, rows: int, k_max: int) -> int:
        """Capture the draft layers' per-layer CUDA graphs (quant.graphs) for the forwards a
        window of up to `rows` rows and `k_max` steps makes, now, at build time
        (`SelfDraft.warm_graphs`); the captures made. The target's own instance feeds one
        token a row per step; a second instance also catches up on unseen tokens."""
        if self.self_draft is not None:
            return self.self_draft.warm_graphs(range(1, rows + 1))
        instance = getattr(self, "instance", None)
        return instance.warm_graphs(range(1, (k_max + 1) * rows + 1)) if instance else 0

    def reset(self) -> None:
        self.kv_copy_bytes = self.kv_copies = 0
        if hasattr(self.layout, "compiles"):  # what compiles during the next request
            self._compiled_before = (self.layout.compiles, self.layout.compile_s)

    def compile_record(self) -> dict:
        """A compiled layout's compilations during the request (none: no columns)."""
        if not hasattr(self.layout, "compiles"):
            return {}
        n, seconds = getattr(self, "_compiled_before", (0, 0.0))
        return {"draft_compiles": self.layout.compiles - n,
                "draft_compile_s": self.layout.compile_s - seconds}

    def as_record(self) -> dict:
        return {}

    def _charge_kv_copy(self, tokens: int, rows: int, cache, nbytes: int | None = None) -> None:
        """One per-window copy of the committed KV (`tokens` positions of `rows` sequences,
        holes included: the copy is the whole rectangle; `nbytes` when the caller measured
        them), device to device: on
        the virtual clock the charged sizes' KV bytes (the real model's under charge=real) read
        and written at the device's memory bandwidth, plus one copy kernel per layer's K and V;
        real clocks measure the copy itself."""
        cost = self.timing.cost
        if charges_virtually(self.timing):
            s = cost.sizes
            layers = len(self.target_model.model.layers) * s.attn_multiplier
            nbytes = int(round(rows * tokens * s.kv_elems_per_token * s.elem_bytes * layers))
            self.timing.link.compute(2 * nbytes / cost.hw.mem_bandwidth_Bps
                                     + 2 * layers * cost.hw.launch_overhead_s)
        elif nbytes is None:
            nbytes = cache_bytes(cache)
        self.kv_copy_bytes += nbytes
        self.kv_copies += 1


def draft_experts_charge(timing: Timing, draft: Draft):
    """A draft listener charging the router and the fused INT4 experts of one draft layer to
    the virtual clock (one kernel over every routed expert the layer's tokens chose), and its
    every-layer form for a compiled step (one read of the step's routes, counted on the host).
    Returns `(per_layer, all_layers)`, the two arguments of `listen`."""
    cost, link, spec = timing.cost, timing.link, draft.experts.spec

    def charge_counts(tokens: int, per_expert: list[int]) -> None:
        link.compute(cost.router_s(tokens))
        link.compute(cost.draft_experts_s(per_expert, spec.bits, spec.group))

    def charge(layer: int, top_k_index: torch.Tensor) -> None:
        with charging_only():
            counts = torch.bincount(top_k_index.flatten())
            per_expert = counts[counts > 0].tolist()  # host sync: charging only
        charge_counts(top_k_index.shape[0], per_expert)

    def charge_all(routes: torch.Tensor) -> None:
        for tokens, per_expert in routed_counts(routes):
            charge_counts(tokens, per_expert)
    return charge, charge_all


class SelfInt4Draft(DraftPart):
    """The target's own instance in draft mode: its routed experts from their INT4 copy."""

    def __init__(self, model, draft: Draft, device: torch.device, timing: Timing):
        self.draft, self.timing, self.target_model = draft, timing, model
        self.self_draft = SelfDraft(model, draft.experts, draft.backend, device,
                                    graphs=draft.graphs)
        self.device_bytes = self.self_draft.draft_bytes
        if charges_virtually(timing):
            self.listen(*draft_experts_charge(timing, draft))

    def use_static(self, compiler: str, mode: str | None = None, positions: int = 0,
                   capture=None, clock: NullClock = NULL_CLOCK) -> None:
        """Draft in a static cache, each step one compiled graph (static_draft.py; `capture`:
        captured as one CUDA graph), charged after it by `clock`, the target's (its hooks do
        not run inside the compiled step); each window's copy of newly committed KV is charged
        as a device copy."""
        from specter.decoding.static_draft import StaticDraft

        self.layout = StaticDraft(self.self_draft, compiler, mode, on_copy=self._charge_kv_copy,
                                  positions=positions, capture=capture, clock=clock)

    def as_record(self) -> dict:
        static = self.layout is not None
        return {**self.draft.as_record(), "shared_instance": True, **self.compile_record(),
                "draft_kv": "static" if static else "shared",
                "kv_copy_bytes": self.kv_copy_bytes, "kv_copies": self.kv_copies}


def load_separate_draft_model(job):
    """The same checkpoint loaded a second time as a stand-alone draft: its routed experts
    will be the INT4 copy only (their full-precision tensors are never read)."""
    files = job.files
    second = load_model(files.model, job.device, files.cache_dir, files.model_seed,
                        progress=False, plan=PlacementPlan("none")).model
    for _, m in experts_modules(second):
        release_fused(m, -1)  # still an experts module for introspection
    return second


class SeparateInt4Draft(DraftPart):
    """A second instance drafting with the INT4 copy: its own non-expert weights, and its own
    KV cache (`kv_copy=False`, SpecMoEOff's layout, catching up on the tokens it has not seen)
    or the target's committed KV copied to it at every window's start (`kv_copy=True`,
    charged as a device copy)."""

    def __init__(self, target_model, draft_model, draft: Draft, device: torch.device,
                 timing: Timing, kv_copy: bool = False):
        self.draft, self.timing, self.target_model = draft, timing, target_model
        self.layout = CopiedKVDraft(draft_model, self._charge_kv_copy) if kv_copy \
            else SeparateDraft(draft_model)
        self.instance = SelfDraft(draft_model, draft.experts, draft.backend, device,
                                  graphs=draft.graphs)
        self.instance.mode = "draft"  # this instance is only ever the draft
        self.clock = timing.observer(draft_model, charge_experts=False)
        if charges_virtually(timing):
            self.listen(*draft_experts_charge(timing, draft))
        # the INT4 copy (counted once) and the second instance's non-expert weights
        self.device_bytes = self.instance.draft_bytes + sum(
            p.numel() * p.element_size() for p in draft_model.parameters())
        self.kv_copy_bytes = self.kv_copies = 0

    def listen(self, fn, all_layers=None, in_graph: bool = False) -> None:
        self.instance.listen(fn, all_layers, in_graph)

    def use_static(self, compiler: str, mode: str | None = None, positions: int = 0,
                   capture=None, clock: NullClock = NULL_CLOCK) -> str | None:
        """Draft in a static cache of its own, each step one compiled graph (static_draft.py
        `own_kv`; `capture`: captured as one CUDA graph), charged by this instance's own clock
        after each step (not the target's `clock`); None, or why not."""
        if isinstance(self.layout, CopiedKVDraft):
            return "eager: a per-window copy of the target's KV (system.kv_copy) stays eager"
        from specter.decoding.static_draft import StaticDraft

        self.layout = StaticDraft(self.instance, compiler, mode, positions=positions,
                                  clock=self.clock,
                                  own_kv=True, capture=capture)
        return None

    def before_forward(self, tokens: int, context: int, phase: str, rows: int = 1) -> None:
        self.clock.begin_forward(tokens, context, phase == "prefill", rows)

    def as_record(self) -> dict:
        copied = isinstance(self.layout, CopiedKVDraft)
        return {**self.draft.as_record(), "shared_instance": False,
                "draft_kv": "copied" if copied else "own", **self.compile_record(),
                "kv_copy_bytes": self.kv_copy_bytes, "kv_copies": self.kv_copies}
