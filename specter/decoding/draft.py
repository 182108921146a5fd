"""The draft: what proposes K tokens in a window, where its KV lives, and its steps.

A speculative engine's draft is one part with the small interface of `Draft`:
- `SelfInt4Draft`: the target's own instance drafts with the INT4 copy of its routed experts
  (Specter's SIC, LRU-S, SP-E/SP-L): one model, one KV cache, the draft mode switched in
  (the experts dispatcher's, specter/experts.py; its INT4 layers: draft_mode.py).
- `SeparateInt4Draft`: a second instance of the same checkpoint whose routed experts are the
  INT4 copy only, with its own KV cache (SpecMoEOff) or a per-window copy of the target's
  (Specter's no-sharing ablation, the artifact's "SIC off").
- A draft that computes its experts elsewhere supplies the same interface (SpecMoE's host
  draft, baselines/specmoe.py).

Where a draft's KV lives is its layout, with `steps(...)` (propose K tokens over a cache, one
forward per step: loop.py's `draft_steps` over the batch cache, or the compiled step's, both
running loop.py's one draft-step loop `run_steps`, a generator, so the window loop plans its
prefetches between the steps) and `commit`: `SharedKV` (loop.py, beside the loop it serves:
the target's own instance in draft mode over the target's cache, Specter's layout: the
proposals' KV is cropped after the window), `OwnKV` (here: a second model with its own cache,
SpecMoEOff's), `CopiedKV` (a second model reading a per-window copy of the target's KV) and
the compiled step's `StaticKV` (compiled_draft.py).

Each draft: `draft_mode` (the target's `DraftMode` whose draft mode the loop switches in; None
when the draft is a second model), `layout` (None: `SharedKV` over the target's cache),
`listen(fn, all_layers)` (fn(moe_layer, top_k_index [T, k]) told of every draft experts call:
the clock's charge, a window prefetcher; `all_layers(routes [L, T, k])` its form for a compiled
step's every layer at once), `device_bytes` (device memory beyond the target's own
parameters and expert slots), `observers` (what of it hears the loop's events besides the
engine's own: decoding/loop.py `Events`; a second instance's compute clock), `reset()` and
`as_record()`.
Does not own: the INT4 experts themselves (quant/), acceptance, the window loop (loop.py).
"""

from __future__ import annotations


import dataclasses

import torch

from specter.counting import charging_only, routed_counts
from specter.decoding.compiled_draft import EAGER, CompiledMode, eager_batch_record
from specter.decoding import loop
from specter.decoding.loop import Events, SharedKV, acceptance, speculative_batch
from specter.decoding.draft_mode import DraftMode
from specter.decoding.batch import BatchCache, Generation, cache_bytes
from specter.models.introspect import experts_modules
from specter.placement.loader import load_model
from specter.placement.plan import PlacementPlan
from specter.clock.timing import Timing
from specter.offload.store import release_fused
from specter.quant.build import Int4Experts


class Draft:
    """The interface above, with its no-op defaults: a draft subclasses it and sets
    `draft_mode` or `layout`."""

    draft_mode: DraftMode | None = None
    timing: Timing | None = None
    target_model = None
    instance: DraftMode | None = None  # a second model's draft mode (SeparateInt4Draft)
    kv_copy_bytes = kv_copies = 0
    layout = None  # where and how it drafts (draft.py, compiled_draft.py); None: SharedKV
    _compiled_before = (0, 0.0)  # a compiled layout's (compiles, seconds) before this request
    device_bytes = 0
    observers: tuple = ()  # hear the loop's events (decoding/loop.py `Events`)
    eager_now = False  # this request drafts in `eager_layout()`, not in `layout` (`layout_for`)

    def layout_for(self, rows: int):
        """Where a request of `rows` rows drafts: `layout` (None: `SharedKV` over the target's
        cache), unless `layout` decodes fewer rows (`max_rows`: the compiled step's `StaticKV`,
        one row, chosen for a job of one row): then `eager_layout()`, where spec.compile=off
        drafts. The engine decodes any batch on any clock; the output is the target's either
        way (verification decides), and the record says the request drafted eagerly
        (`compiled_record`)."""
        self.eager_now = rows > getattr(self.layout, "max_rows", rows)
        return self.eager_layout() if self.eager_now else self.layout

    def eager_layout(self):
        """The layout a batch drafts in when `layout` decodes one row (None: `SharedKV`)."""
        return None

    def compiled_record(self, record: dict, rows: int) -> dict:
        """The engine's `draft_compile*` columns for the request `layout_for` last chose."""
        return {**record, **eager_batch_record(rows)} if self.eager_now else record

    def listen(self, fn, all_layers=None, in_graph: bool = False) -> None:
        self.draft_mode.listen(fn, all_layers, in_graph)

    def warm_graphs(self, rows: int, k_max: int) -> int:
        """Capture the draft layers' per-layer CUDA graphs (quant.graphs) for the forwards a
        window of up to `rows` rows and `k_max` steps makes, now, at build time
        (`DraftMode.warm_graphs`); the captures made. The target's own instance feeds one
        token a row per step; a second instance also catches up on unseen tokens."""
        if self.draft_mode is not None:
            return self.draft_mode.warm_graphs(range(1, rows + 1))
        instance = self.instance
        return instance.warm_graphs(range(1, (k_max + 1) * rows + 1)) if instance else 0

    def reset(self) -> None:
        self.kv_copy_bytes = self.kv_copies = 0
        if hasattr(self.layout, "compiles"):  # what compiles during the next request
            self._compiled_before = (self.layout.compiles, self.layout.compile_s)

    def compile_record(self) -> dict:
        """A compiled layout's compilations during the request (none: no columns)."""
        if not hasattr(self.layout, "compiles"):
            return {}
        n, seconds = self._compiled_before
        return {"draft_compiles": self.layout.compiles - n,
                "draft_compile_s": self.layout.compile_s - seconds,
                "kernels.draft_step": self.layout.step_kernels}

    def as_record(self) -> dict:
        return {}

    def _charge_kv_copy(self, tokens: int, rows: int, cache, nbytes: int | None = None) -> None:
        """One per-window copy of the committed KV (`tokens` positions of `rows` sequences,
        holes included; `nbytes` when the caller measured them), device to device: charged on
        the virtual clock (clock/observer.py `kv_copy`: the charged sizes' KV bytes, the real
        model's under charge=real); real clocks measure the copy itself."""
        charged = self.timing.observer(None, False).kv_copy(
            rows * tokens, len(self.target_model.model.layers))
        if charged is not None:
            nbytes = charged
        elif nbytes is None:
            nbytes = cache_bytes(cache)
        self.kv_copy_bytes += nbytes
        self.kv_copies += 1


def draft_experts_charge(timing: Timing, int4: Int4Experts):
    """A draft listener charging the router and the fused INT4 experts of one draft layer to
    the virtual clock (one kernel over every routed expert the layer's tokens chose), and its
    every-layer form for a compiled step (one read of the step's routes, counted on the host).
    Returns `(per_layer, all_layers)`, the two arguments of `listen`."""
    clock, spec = timing.observer(None, False), int4.experts.spec
    dequantized = int4.backend == "gather_int4"  # each pair's weights written out, read back

    def charge_counts(tokens: int, per_expert: list[int]) -> None:
        clock.draft_experts(tokens, per_expert, spec.bits, spec.group, dequantized)

    def charge(layer: int, top_k_index: torch.Tensor) -> None:
        with charging_only():
            counts = torch.bincount(top_k_index.flatten())
            per_expert = counts[counts > 0].tolist()  # host sync: charging only
        charge_counts(top_k_index.shape[0], per_expert)

    def charge_all(routes: torch.Tensor) -> None:
        for tokens, per_expert in routed_counts(routes):
            charge_counts(tokens, per_expert)
    return charge, charge_all


class SelfInt4Draft(Draft):
    """The target's own instance in draft mode: its routed experts from their INT4 copy."""

    def __init__(self, model, int4: Int4Experts, device: torch.device, timing: Timing,
                 compiled: CompiledMode = EAGER):
        """`compiled` (compiled_draft.py `compiled_mode`): the step compiled over a static
        cache (`StaticKV`, charged after each step by the target's clock, its hooks not running
        inside; each window's copy of newly committed KV charged as a device copy), or eager
        over the target's own cache."""
        self.int4, self.timing, self.target_model = int4, timing, model
        self.draft_mode = DraftMode(model, int4.experts, int4.backend, device,
                                    graphs=int4.graphs)
        self.device_bytes = self.draft_mode.draft_bytes
        if timing.charged:
            self.listen(*draft_experts_charge(timing, int4))
        self.layout = compiled.static_kv(self.draft_mode, on_copy=self._charge_kv_copy)

    def as_record(self) -> dict:
        static = self.layout is not None and not self.eager_now
        return {**self.int4.as_record(), "shared_instance": True, **self.compile_record(),
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


class SeparateInt4Draft(Draft):
    """A second instance drafting with the INT4 copy: its own non-expert weights, and its own
    KV cache (`kv_copy=False`, SpecMoEOff's layout, catching up on the tokens it has not seen)
    or the target's committed KV copied to it at every window's start (`kv_copy=True`,
    charged as a device copy)."""

    def __init__(self, target_model, draft_model, int4: Int4Experts, device: torch.device,
                 timing: Timing, kv_copy: bool = False, compiled: CompiledMode = EAGER):
        """`compiled` (compiled_draft.py `compiled_mode`): its step compiled in a static cache
        of its own (`StaticKV` own_kv, charged by this instance's own clock after each step;
        `kv_copy` stays eager), or its layers replayed as CUDA graphs (`graph_layers`)."""
        if compiled.graph_layers:  # auto's fallback where the step stays eager
            int4 = dataclasses.replace(int4, graphs=True, graphs_choice=compiled.graph_layers)
        self.int4, self.timing, self.target_model = int4, timing, target_model
        self.instance = DraftMode(draft_model, int4.experts, int4.backend, device,
                                  graphs=int4.graphs, mode="draft")  # only ever the draft
        self.clock = timing.observer(draft_model, charge_experts=False)
        self.observers = (self.clock,)  # its forwards charged, told of every forward's size
        self.layout = (CopiedKV(draft_model, self._charge_kv_copy) if kv_copy
                       else compiled.static_kv(self.instance, clock=self.clock, own_kv=True)
                       or OwnKV(draft_model))
        self.draft_model = draft_model
        if timing.charged:
            self.listen(*draft_experts_charge(timing, int4))
        # the INT4 copy (counted once) and the second instance's non-expert weights
        self.device_bytes = self.instance.draft_bytes + sum(
            p.numel() * p.element_size() for p in draft_model.parameters())
        self.kv_copy_bytes = self.kv_copies = 0

    def listen(self, fn, all_layers=None, in_graph: bool = False) -> None:
        self.instance.listen(fn, all_layers, in_graph)

    def eager_layout(self):
        """Its own KV, eager (SpecMoEOff's layout), for a batch the static step cannot take."""
        return OwnKV(self.draft_model)

    def as_record(self) -> dict:
        copied = isinstance(self.layout, CopiedKV)
        return {**self.int4.as_record(), "shared_instance": False,
                "draft_kv": "copied" if copied else "own", **self.compile_record(),
                "kv_copy_bytes": self.kv_copy_bytes, "kv_copies": self.kv_copies}


class OwnKV:
    """A draft that is a second model with its own KV cache (SpecMoEOff's layout), instead of
    the shared instance's draft mode over the target's cache. Its cache keeps the draft's KV of
    committed tokens; tokens it has not seen (the target's corrections) are fed in one block
    at the start of the next window (a batch's rows right-aligned, as `BatchCache` feeds)."""

    def __init__(self, model):
        self.model = model
        self.kv: BatchCache | None = None

    def start(self, target: BatchCache) -> None:
        """After the target's prefill: its own cache of as many rows."""
        self.kv = BatchCache(self.model, target.device, target.rows)

    @property
    def held_bytes(self) -> int:
        """Device bytes of its own KV cache (the second cache a shared instance saves)."""
        return 0 if self.kv is None else cache_bytes(self.kv.cache)

    def steps(self, kv: BatchCache, seqs: list[list[int]], k_effs: list[int], pick,
              stop: set[int], out: list[list[int]], events, on_device: bool = False):
        """`draft_steps` in its own cache for rows whose committed tokens are `seqs` (the
        target's cache `kv` is read only by a copying draft: `sync`)."""
        self.sync(kv)
        feeds = [seq[self.kv.valid[r]:] for r, seq in enumerate(seqs)]  # unseen, then pending
        yield from loop.draft_steps(self.kv, feeds, k_effs, pick, stop, out, events, on_device)

    def sync(self, target: BatchCache) -> None:
        """At a window's start, before drafting (own KV: nothing to do)."""

    def commit(self, n_valid: list[int]) -> None:
        """Row r keeps the draft's KV of its first `n_valid[r]` tokens only."""
        self.kv.keep(n_valid)

    def select(self, rows: list[int]) -> None:
        if self.kv is not None:
            self.kv.select(rows)


class CopiedKV(OwnKV):
    """A second model whose KV is a copy of the target's committed KV, made at the start of
    every window (the authors' artifact's "SIC off": weights apart, KV copied per window, not
    shared). The draft so reads exactly the target's KV, as the shared instance does: the
    same proposals, the same acceptance; what it costs is the copy (`on_copy(positions,
    rows, cache)` is told of each, to charge it) and the copy's memory."""

    def __init__(self, model, on_copy=None):
        super().__init__(model)
        self.on_copy = on_copy

    def sync(self, target: BatchCache) -> None:
        self.kv = target.copy_for(self.model)  # every layer's K and V, device to device
        if self.on_copy is not None:
            self.on_copy(self.kv.length, self.kv.rows, self.kv.cache)

    def commit(self, n_valid: list[int]) -> None:
        """Nothing kept: the next window copies the target's KV afresh."""
        self.kv = None


@torch.no_grad()
def speculative_greedy(model, shared, prompt_ids: list[int], max_new_tokens: int, k: int,
                       device: torch.device, clock, stop: set[int], memory,
                       events: "Events | None" = None, temperature: float = 0.0,
                       generator: torch.Generator | None = None, layout=None, on_commit=None) -> Generation:
    """One request: `speculative_batch` of one row, drafting in `layout` (None: `SharedKV`
    over `shared`, a `DraftMode`); `on_commit(tokens)` hears each commit."""
    return speculative_batch(model, layout or SharedKV(shared), [prompt_ids], max_new_tokens, k,
                             device, clock, stop, memory, events,
                             acceptance(temperature, None if generator is None else [generator],
                                        1),
                             on_commit=None if on_commit is None else [on_commit])[0]
