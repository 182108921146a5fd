"""The two engines every decoding system is made of.

An engine is a decoding loop x a draft x a prefetcher x an eviction policy:

- `GreedyEngine`: autoregressive greedy decoding, all experts resident (`runtime=None`) or
  offloaded through an `OffloadRuntime` (its eviction policy and any per-layer
  `LayerPrefetcher` are the runtime's).
- `SpeculativeEngine`: draft -> verify -> accept (`decoding/loop.py`) over offloaded experts,
  with a draft part (`decoding/draft.py`, or a system's own) and an optional
  `WindowPrefetcher` told of the draft's routing and steps.

Systems are recipes choosing the parts and their knobs (`specter/specter_recipe.py`, `baselines/`);
no system subclasses an engine. Each engine owns what every system shares: the stop set, the
device-memory account, the compute clock (clock/observer.py), the per-request reset and the
record columns.
"""

from __future__ import annotations

import copy
import functools

import torch

from specter.decoding.depth import Depth, SlotView
from specter.decoding.loop import (Drawn, Events, SharedKV, acceptance, greedy_decode_batch,
                                   limits_of, speculative_batch)
from specter.decoding.compiled_draft import compiled_mode
from specter.decoding.batch import DeviceMemory, Generation, eos_ids
from specter.clock.observer import NULL_CLOCK, NullClock
from specter.clock.timing import Timing, timing_for
from specter.offload.build import offload_model
from specter.offload.prefetch import LayerPrefetcher, WindowPrefetcher
from specter.offload.runtime import OffloadRuntime
from specter.quant.build import Int4Experts


class GreedyEngine:
    """Autoregressive greedy decoding; `runtime=None`: every expert resident (HF's own)."""

    speculates = False
    samples = True  # workload.temperature > 0: each token drawn (`seed_requests` per batch)
    batches = True  # decodes workload.batch requests together (generate_batch)

    def __init__(self, name: str, model, device: torch.device, timing: Timing,
                 runtime: OffloadRuntime | None = None, stop_on_eos: bool = True,
                 static=None, temperature: float = 0.0):
        self.name, self.model, self.device = name, model, device
        self.temperature = temperature  # > 0: each token drawn (`Drawn`, `self.generators`)
        self.generators: list[torch.Generator] | None = None
        self.timing, self.runtime = timing, runtime
        self.stop = eos_ids(model) if stop_on_eos else set()
        slots = runtime.cache.device_bytes() if runtime is not None else 0
        self.memory = DeviceMemory(model, device, extra_bytes=slots)
        self.clock = timing.observer(model, charge_experts=runtime is None)
        # who hears of each forward (decoding/loop.py `Events`): the clock, the hit rate
        self.events = Events(self.clock, runtime.stats if runtime is not None else None)
        self.prefetcher: LayerPrefetcher | None = runtime.prefetcher if runtime else None
        # resident's system.compile, `static(timing, clock)` -> (a CompiledDecode, batch-1
        # decode steps compiled, or None; its record columns)
        self.static, self.compiled = static(timing, self.clock) if static else (None, {})

    def reset(self) -> None:
        """The fixed initial resident set and statistics, before each request (outside timing)."""
        if self.runtime is None:
            self.timing.link.reset_stats()
            return
        self.timing.link.synchronize()
        self.runtime.reset()
        if self.prefetcher is not None:
            self.prefetcher.reset()

    def seed_requests(self, seeds: list[int]) -> None:
        """One sampling generator per request of the next batch (workload.temperature > 0)."""
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_commit=None) -> Generation:
        """One request; `on_commit(tokens)` hears each token as it is committed (the
        `Engine` protocol), on the compiled path as on the eager one."""
        if on_commit is None:  # through generate_batch, as ever (a measurement may wrap it)
            return self.generate_batch([prompt_ids], max_new_tokens)[0]
        return self._decode([prompt_ids], max_new_tokens, [on_commit])[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                       on_commit: list | None = None) -> list[Generation]:
        """The requests decoded together (`max_new_tokens`: one limit or one per request;
        `on_commit`: one listener or None per request, as `generate`'s); the batch's
        statistics (demand, link, prefetcher) are the same columns on every row."""
        return self._decode(prompts, max_new_tokens, on_commit)

    def _draw(self, rows: int) -> Drawn | None:
        """At temperature > 0, each request's tokens drawn from its generator (seeded by
        `seed_requests`, as the runner and the library seed each request)."""
        if self.temperature <= 0:
            return None
        if self.generators is None or len(self.generators) != rows:
            raise ValueError("sampling needs one torch.Generator per request (seeded per request)")
        return Drawn(self.temperature, self.generators)

    def _decode(self, prompts: list[list[int]], max_new_tokens: int,
                on_commit: list | None = None) -> list[Generation]:
        """`generate_batch`, with a listener per request or None (`generate`'s)."""
        if self.static is not None and len(prompts) == 1:
            before = self.static.compiles, self.static.compile_s
            with torch.no_grad():
                gens = [self.static.generate(prompts[0], limits_of(max_new_tokens, 1)[0],
                                             self.device,
                                             self.timing.link, self.stop, self.memory,
                                             self.events,
                                             on_commit=None if on_commit is None else on_commit[0])]
            self.compiled.update(decode_compiles=self.static.compiles - before[0],  # this request's
                                 decode_compile_s=self.static.compile_s - before[1])
        else:
            gens = greedy_decode_batch(self.model, prompts, max_new_tokens, self.device,
                                       self.timing.link, self.stop, self.memory,
                                       self.events, on_commit=on_commit,
                                       draw=self._draw(len(prompts)))
        shared = dict(self.compiled)
        if self.runtime is not None:
            shared.update(self.runtime.as_record())
        shared.update(self.timing.link_record())
        if self.prefetcher is not None:
            shared.update(self.prefetcher.as_record())
        add_prefetches(shared)
        for gen in gens:
            gen.stats.update(shared)
        return gens


class SpeculativeEngine:
    """Speculative decoding over offloaded target experts: `draft` proposes, the target
    verifies through `runtime`, `window` (optional) prefetches for the coming verification."""

    speculates = True
    samples = True  # workload.temperature > 0: speculative sampling (seed_requests per batch)
    batches = True

    def __init__(self, name: str, model, device: torch.device, timing: Timing,
                 runtime: OffloadRuntime, draft, depth: Depth,
                 clock: NullClock = NULL_CLOCK, window: WindowPrefetcher | None = None,
                 stop_on_eos: bool = True, temperature: float = 0.0, compiled: dict | None = None,
                 pieces: tuple = (None, "off")):
        self.name, self.model, self.device = name, model, device
        # verification's runner (decoding/verify_pieces.py `pieces_for`) and its record; the
        # loop's verify forward runs inside `self.pieces()` (None: transformers' forward)
        runner, self.pieces_why = pieces
        self.pieces = None
        if runner is not None:
            from specter.decoding.verify_pieces import pieces as in_pieces
            self.pieces = functools.partial(in_pieces, runner)
        self.timing, self.runtime, self.draft = timing, runtime, draft
        self.depth = depth  # how deep it drafts, settled once (decoding/depth.py)
        self.k, self.k_source = depth.k, depth.source
        # spec.k=adaptive: each window's K, with the slots and the link in view; else None
        self.adaptive = depth.policy(slot_view(runtime, timing))
        self.window = window or WindowPrefetcher()
        self.stop = eos_ids(model) if stop_on_eos else set()
        self.memory = DeviceMemory(model, device,
                                   extra_bytes=runtime.cache.device_bytes() + draft.device_bytes)
        # the target's forwards, charged on a virtual clock (build_speculative subscribes it)
        self.clock = clock
        draft.listen(self.window.on_draft_experts, self.window.on_draft_routes,
                     in_graph=self.window.routes_in_graph)
        # who hears of each forward, draft step and window end (decoding/loop.py `Events`): the
        # clock, a second draft instance's clock, the hit rate (verification's demand only),
        # the window prefetcher
        self.events = Events(clock, *draft.observers, runtime.stats, self.window)
        self.compiled = compiled or {"draft_compiled": False, "draft_compile": "eager",
                                     "draft_captured": False, "draft_graphs": False}
        self.temperature = temperature  # > 0: speculative sampling, `self.generators`
        self.generators: list[torch.Generator] | None = None

    def reset(self) -> None:
        self.timing.link.synchronize()
        self.runtime.reset()
        self.draft.reset()
        self.window.reset()
        if self.adaptive is not None:
            self.adaptive.reset()

    def with_depth(self, k: int, source: str) -> "SpeculativeEngine":
        """An engine over the same parts that drafts K tokens every window (the depth
        profiler's K, `source` saying so); this one is unchanged."""
        other = copy.copy(self)
        other.k, other.k_source = k, source
        return other

    def seed_requests(self, seeds: list[int]) -> None:
        """One sampling generator per request of the next batch (workload.temperature > 0)."""
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_commit=None) -> Generation:
        """One request; `on_commit(tokens)` hears each commit (the `Engine` protocol): the
        prefill's token, then each window's accepted proposals and the target's token."""
        if on_commit is None:  # through generate_batch, as ever (a measurement may wrap it)
            return self.generate_batch([prompt_ids], max_new_tokens)[0]
        return self._decode([prompt_ids], max_new_tokens, [on_commit])[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                       on_commit: list | None = None) -> list[Generation]:
        """The requests decoded together, each accepting its own proposals (`max_new_tokens`:
        one limit or one per request; `on_commit`: one listener or None per request); the
        batch's statistics (demand, link, draft, window prefetcher) are the same columns on
        every row, acceptance is each row's own."""
        return self._decode(prompts, max_new_tokens, on_commit)

    def _decode(self, prompts: list[list[int]], max_new_tokens: int,
                on_commit: list | None = None) -> list[Generation]:
        """`generate_batch`, with a listener per request or None (`generate`'s)."""
        # a compiled step decodes one row: a batch drafts in the eager layout (draft.py)
        layout = self.draft.layout_for(len(prompts))
        gens = speculative_batch(self.model, layout or SharedKV(self.draft.draft_mode),
                                 prompts, max_new_tokens, self.k, self.device, self.timing.link,
                                 self.stop, self.memory, self.events,
                                 accept=acceptance(self.temperature, self.generators, len(prompts)),
                                 depth=self.adaptive, on_commit=on_commit, pieces=self.pieces)
        shared = {**self.runtime.as_record(), **self.timing.link_record(),
                  **self.draft.as_record(),
                  **self.draft.compiled_record(self.compiled, len(prompts)),
                  "k_source": self.k_source, "verify_pieces": self.pieces_why,
                  "k_why": self.adaptive.why if self.adaptive is not None else self.k_source,
                  "staged_loads": self.runtime.cache.staged_loads,  # prefetches into staging
                  "reorder": not self.runtime.serial, "overlap": self.runtime.overlap,
                  **self.window.as_record()}
        add_prefetches(shared)
        for gen in gens:
            gen.stats.update(shared)
        return gens


def add_prefetches(record: dict) -> None:
    """The request's `prefetches`: every copy its prefetchers issued, the layer prefetcher's
    (`layer_prefetches`, counted by the runtime: offload/runtime.py `prefetch`) and the window
    prefetcher's (`window_prefetches`, its own record), each column written by one owner;
    none where nothing prefetches."""
    if "layer_prefetches" in record or "window_prefetches" in record:
        record["prefetches"] = (record.get("layer_prefetches", 0)
                                + record.get("window_prefetches", 0))


def slot_view(runtime: OffloadRuntime, timing: Timing) -> SlotView:
    """The adaptive depth's view of the slots and the link: the runtime's slots per MoE layer
    and routing, and one expert's copy in seconds on the run's clock (the cost model's rate on
    a modelled clock, scaled to an emulated one; the link profile's on a real one)."""
    cache, rates, link = runtime.cache, runtime.rates, timing.link
    if rates is not None:
        copy_s = rates.transfer_s(rates.expert_transfer_bytes()) * link.time_scale
    else:
        copy_s = link.profile.transfer_s(cache.transfer_bytes)
    return SlotView(runtime, cache.slots + cache.staging, cache.layout.num_experts, copy_s)


def build_greedy(job, name: str, prefetcher: LayerPrefetcher | None = None,
                 offload: bool = True, host_compute: bool = False,
                 host_all: bool = False, static=None) -> GreedyEngine:
    """A greedy engine for `job` (specs.py): experts offloaded (with `prefetcher`), or all resident;
    `host_compute`: misses computed on the host when that ends sooner than their copy;
    `host_all`: every routed expert computed on the host, no slots (host_experts); `static`:
    resident's compiled decode step (baselines/resident.py)."""
    timing = timing_for(job)
    runtime = offload_model(job, timing, prefetcher, host_all=host_all,
                            host_misses=host_compute) if offload else None
    return GreedyEngine(name, job.loaded.model, job.device, timing, runtime,
                        stop_on_eos=job.stop_on_eos, static=static, temperature=job.temperature)


def build_speculative(job, name: str, make_draft, window=None, reorder: bool = True,
                      overlap: bool = True, host_compute: bool = False,
                      host_all: bool = False, int4: Int4Experts | None = None,
                      copied_kv: bool = False) -> SpeculativeEngine:
    """A speculative engine for `job` (specs.py). `make_draft(timing, runtime, compiled)` builds
    the draft part once the target's experts are offloaded, complete: `compiled`, its
    `CompiledMode` (spec.compile, decided here from `int4`, the INT4 experts it drafts with, None
    for a draft that computes its experts otherwise, and `copied_kv`, a second instance reading
    a per-window copy of the target's KV; compiled_draft.py `compiled_mode`). Quantize before,
    from the full-precision experts: `specter.quant.build.int4_experts_for`.
    `window(runtime, timing, draft)` builds the window prefetcher, or None. `host_all`:
    verification's experts all on the host (no slots). `reorder=False` verifies token by
    token, `overlap=False` loads verification's misses serially (the runtime's ablations). K:
    `job.draft.depth`, settled once by the harness with the one rule of `decoding/depth.py
    settle_depth` (a recipe's `OWN_K` included); under spec.k=auto the harness profiles the
    built engine (experiments/depth_profile.py)."""
    timing = timing_for(job)
    runtime = offload_model(job, timing, host_all=host_all, host_misses=host_compute,
                            serial=not reorder, overlap=overlap)
    depth = job.draft.depth
    # the target's forwards, charged on a virtual clock; a compiled draft step of the target's
    # own instance is charged by it after the step runs (its hooks do not run inside)
    clock = timing.observer(job.loaded.model, charge_experts=False)
    compiled = compiled_mode(job, int4, timing.kind, depth.k_max, clock, copied_kv)
    from specter.decoding.verify_pieces import pieces_for

    pieces = pieces_for(job, timing, clock)
    draft = make_draft(timing, runtime, compiled)
    if not timing.kind.charged:  # per-layer CUDA graphs captured now, not in a timed window
        draft.warm_graphs(job.rows, depth.k_max)
    return SpeculativeEngine(name, job.loaded.model, job.device, timing, runtime, draft, depth,
                             clock=clock, window=window(runtime, timing, draft) if window else None,
                             stop_on_eos=job.stop_on_eos, temperature=job.temperature,
                             compiled=compiled.record, pieces=pieces)


def resident_engine(model, device: torch.device, stop_on_eos: bool = True,
                    timing: Timing | None = None) -> GreedyEngine:
    """Every expert on the device, plain greedy decoding (real time unless `timing`)."""
    return GreedyEngine("resident", model, device, timing or Timing.wall(device),
                        stop_on_eos=stop_on_eos)
