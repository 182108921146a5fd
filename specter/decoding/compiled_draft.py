"""The shared instance's draft step as one compiled graph, over a static draft cache.

Owns: `StaticKV`, the draft layout `spec.compile` switches in for the target's own instance
(Specter, LRU-S, SP-E/SP-L), and `compiled_mode`, the engine's record of quant/step_form.py's
answer (`spec.compile=auto|on|off`). The draft
writes its keys and values into preallocated buffers of fixed length (transformers'
`StaticCache`, whose write index is a device tensor), so one draft step (a token id on the
device -> every layer with its INT4 experts -> logits -> the greedy token, left on the device)
has the same shapes at every position of every window and runs as one graph under
`torch.compile(fullgraph=True, dynamic=False)`: no graph break, no host read, no shape that
depends on data. Those are the conditions a CUDA graph capture needs, checked by the compiler.

The buffers mirror the target's committed KV. At each window's start the positions committed
since the last window are copied in from the target's cache (device to device: the accepted
tokens' K and V of every layer, charged as a copy). The draft's own positions past them are
masked until the next window overwrites them. The target's cache and its verification are not
touched, so the output stays the target's. A second instance with its own KV (SpecMoEOff's
layout, `own_kv`) copies nothing: a window's first step feeds the committed tokens it has not
seen and the pending token in one eager forward into its buffers, as its eager layout feeds
them; its other steps are compiled the same way.

On CUDA the whole step is captured as one CUDA graph (`capture`, quant/kernels.py
`capture_graph`): the compiled forward, the argmax, the lookahead buffer's scatter (listeners
that declare themselves graph-safe) and the proposal stored in a window buffer and fed back
as the next step's token. It is captured once per set of buffers, before the first window's
first step (the runner's untimed warm-up request: the capture synchronizes the device once),
and each step is then one replay; the window's proposals are read once, after its last step.

Hooks in the compiled region (the virtual clock's charges, the draft's routing listeners) do
not run inside it: the step records each draft layer's routing as an output, and after the
step the charges and listeners are replayed in the order the eager forward makes them.
Does not own: the window loop (loop.py), the eager layouts (draft.py), the experts
(draft_mode.py), what a forward costs (clock/observer.py `ComputeClock`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specter.clock.graph_kernels import KernelTally
from specter.clock.kinds import ClockKind
from specter.clock.observer import NULL_CLOCK, NullClock
from specter.counting import compiled_region, host_side, to_device
from specter.decoding.batch import BatchCache, cache_bytes
from specter.decoding.loop import run_steps
from specter.models import draft_step
from specter.errors import UserError
from specter.quant.step_form import draft_step_form



def one_write_index(cache) -> torch.Tensor | None:
    """Make every layer of a transformers `StaticCache` (initialized) write at one shared
    index that its forward does not advance (`_one_index_class`); returns it. The caller
    advances it once a forward, by the tokens fed: inside a compiled step one kernel, where
    each layer's own index is one more (27 a step at DeepSeek-V2-Lite's depth). None, and the
    cache left as it is, where a layer is not a plain `StaticLayer` (a sliding window's
    writes wrap around: its own update stays)."""
    from transformers.cache_utils import StaticLayer

    if any(type(layer) is not StaticLayer for layer in cache.layers):
        return None
    index = cache.layers[0].cumulative_length
    for layer in cache.layers:
        layer.__class__ = _one_index_class(type(layer))
        layer.cumulative_length = index
    return index


_ONE_INDEX: dict = {}


def _one_index_class(layer_class):
    """`layer_class` (transformers' StaticLayer) with an `update` that writes the new K and V
    at the shared index and leaves it where it is."""
    if layer_class in _ONE_INDEX.values():
        return layer_class
    if layer_class not in _ONE_INDEX:
        def update(self, key_states, value_states, *args, **kwargs):
            at = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
            self.keys.index_copy_(2, at, key_states)
            self.values.index_copy_(2, at, value_states)
            return self.keys, self.values
        _ONE_INDEX[layer_class] = type("OneIndex" + layer_class.__name__, (layer_class,),
                                       {"update": update, "one_write_index": True})
    return _ONE_INDEX[layer_class]


def index_kept(cache, run):
    """A warm-up for `capture_graph`: `run()` (a step over the static `cache`), then the
    cache's write index put back where it was (the captured step rewrites that K and V)."""
    lengths = [layer.cumulative_length for layer in cache.layers]
    saved = [t.clone() for t in lengths]

    def warm():
        run()
        for t, s in zip(lengths, saved):
            t.copy_(s)
    return warm


@dataclass(frozen=True)
class CompiledMode:
    """`spec.compile` for a draft, decided once before the draft is built (`compiled_mode`),
    so the draft is complete at construction: `on`, its step one compiled graph over a static
    cache (`StaticKV`) built with torch.compile's `compiler`, its buffers holding `positions`,
    captured as one CUDA graph by `capture` (CUDA; None elsewhere) and charged after each
    step by `clock`; `graph_layers`: why its layers are replayed as per-layer CUDA graphs
    instead (auto's fallback where the step stays eager), or None; `record`: its columns."""

    on: bool = False
    compiler: str = "inductor"
    positions: int = 0
    capture: Callable | None = None
    clock: NullClock = NULL_CLOCK
    graph_layers: str | None = None
    record: dict = field(default_factory=lambda: {
        "draft_compiled": False, "draft_compile": "eager", "draft_captured": False,
        "draft_graphs": False})

    def static_kv(self, shared, clock: NullClock | None = None, **kw) -> "StaticKV | None":
        """The compiled layout over `shared` (a `DraftMode`), charged by `clock` (a second
        instance's own; else the target's), or None where the step is eager."""
        if not self.on:
            return None
        return StaticKV(shared, self.compiler, None, positions=self.positions,
                        capture=self.capture, clock=clock or self.clock, **kw)


EAGER = CompiledMode()


def eager_batch_record(rows: int) -> dict:
    """The record of a request of `rows` rows drafted eagerly by an engine whose compiled step
    (`StaticKV`, one row) was chosen for one-row jobs (`Draft.layout_for`)."""
    return {"draft_compiled": False, "draft_captured": False,
            "draft_compile": f"eager: a batch of {rows} rows drafts in the eager layout (the "
                             "compiled step decodes one row)"}

def compiled_mode(job, int4, clock_kind: ClockKind, k_max: int, clock: NullClock = NULL_CLOCK,
                  copied_kv: bool = False) -> CompiledMode:
    """`spec.compile`: an INT4 draft's step (`int4`: its Int4Experts; None: a draft that
    computes its experts otherwise) as one compiled graph over a static cache, where its shapes
    are static; on CUDA the whole step is captured as one CUDA graph (`kernels.capture_graph`:
    at its first step, the runner's untimed warm-up request) and each step is one replay. The
    record says whether and why (`draft_compile`); every fallback of `auto` is said there, and
    `on` refuses it in one sentence. The buffers hold the longest request: its prompt, its new
    tokens and the deepest window (`k_max`, the settled depth's: spec.k=auto's profiled depths
    included). `copied_kv` (a second instance reading a per-window copy of the target's KV)
    stays eager, its layers graphed on CUDA under quant.graphs=auto."""
    from specter.quant.kernels import capture_graph

    spec = job.draft
    if int4 is None:
        if spec.compile == "on":
            raise UserError(f"spec.compile=on compiles an INT4 draft on the device (specter, "
                            f"lru_s, sp_e, sp_l, specmoeoff); {job.system.name} drafts "
                            "otherwise.")
        return CompiledMode(record={**EAGER.record,
                                    "draft_compile": "eager: no INT4 draft on the device"})
    form = draft_step_form(job, int4.backend, copied_kv)  # (quant/step_form.py: the one answer)
    on, why = form.compiled, form.why
    # the layers graphed where the step stays eager and int4_experts_for left them uncaptured
    # (it asked without the copied KV: the step was to be captured whole)
    graph_layers = form.graphs_why if form.layer_graphs and not int4.graphs else None
    # captured: replayed as a CUDA graph, or charged as one on a virtual clock
    captured = on and (form.captured or clock_kind.charged)
    return CompiledMode(on, spec.compile_backend, job.positions + k_max + 1,
                        capture_graph if form.captured else None, clock, graph_layers,
                        {"draft_compiled": on, "draft_compile": why, "draft_captured": captured,
                         "draft_graphs": bool(int4.graphs or graph_layers)})


class StaticKV:
    """The target's own instance (`shared`, a `DraftMode`) drafting in a static cache, one
    compiled graph per step (see the module's docstring). One row at a time.
    `compiler`: torch.compile's backend ("inductor"; "eager" checks the graph without code
    generation, as the tests do); `mode`: its mode (None).
    `capture(fn, warm)`: on CUDA, `quant.kernels.capture_graph`: the whole step (the
    compiled forward, the argmax, the graph-safe listeners' updates: the lookahead buffer's,
    the proposal written into the window's buffer and fed to the next step) captured once as
    one CUDA graph, at the first step (the runner's untimed warm-up request), and each step
    then one replay; the window's proposals are read once, after its last step.
    `on_copy(positions, rows, cache)` is told of each window's copy of newly committed KV;
    `clock` (clock/observer.py) charges after each step what the compiled region did not run
    (`compiled_step`), inside its `captured_step` block (priced as a captured graph's replay).
    `positions`: the longest context a request will reach (prompt, new tokens, a window), so
    that one set of buffers, and one compilation, serves the whole run.
    `max_rows`: the rows a request may have; an engine hands a request of more rows to its
    eager layout instead (`Draft.layout_for`)."""

    max_rows = 1

    def __init__(self, shared, compiler: str = "inductor", mode: str | None = None,
                 on_copy=None, positions: int = 0, own_kv: bool = False,
                 clock: NullClock = NULL_CLOCK, capture=None):
        self.shared, self.model = shared, shared.model
        # own_kv: a second instance's own KV (SpecMoEOff's layout), not a copy of the target's:
        # the committed tokens it has not seen are fed in one eager forward before the steps
        self.own_kv = own_kv
        self.compiler, self.mode = compiler, mode
        self.capture = capture  # capture(fn, warm) -> replay(): the step as one CUDA graph
        self.replay = None  # the captured step (new buffers drop it: captured again)
        self.on_copy, self.clock = on_copy, clock
        self.cache = None  # transformers' StaticCache, kept across requests (one compilation)
        self._index = None  # its layers' one write index (`one_write_index`), or None
        self.capacity = 0
        self.positions = positions
        self.synced = 0  # positions of the target's cache copied in
        self._held = self._per_position = 0  # the buffers' bytes, and per position (`_ensure`)
        # Dynamo keeps compiled graphs per code object, guarded on `self`: every StaticKV
        # would add graphs to the same `_step` until its recompile limit. One engine drafts at a
        # time (a sweep builds one after another), so a new one drops the last one's graphs.
        torch._dynamo.reset()
        draft_step.install()  # DeepSeek-V2 written for the compiler (draft_step.py)
        draft_step.prepare(self.model)  # merged projections (same bytes), chained norms
        self.tally = KernelTally()  # the compiled step's kernels (graph_kernels.py)
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False,
                                  backend=self.tally.backend(compiler) if mode is None
                                  else compiler, mode=mode)
        self.steps_run = 0
        self.compiles = 0  # new buffers: the next step compiles (`compile_s`: their wall time)
        self.compile_s = 0.0
        self.captures = 0  # CUDA graph captures (each synchronizes the device once)
        self._fresh = False
        # captured steps: the step's input token [1, 1], the window's proposals [1, capacity]
        # and where the next one goes [1] (device tensors the graph reads and writes)
        self._tok = self._proposals = self._at = None

    # -- the compiled step --------------------------------------------------------------------
    def _step(self, tok: torch.Tensor):
        """tok [1, 1] -> (next token [1, 1], each MoE layer's routes [1, k]), on the device
        (greedy: the logits stay inside the graph); the draft's K and V written at the cache's
        index, which advances by one. The routes leave the graph as they are: stacked inside
        it, each layer's would be one more copy kernel (`_stepped` stacks them in one)."""
        self.shared.routes = []
        out = self._forward(tok)
        return out.logits[:, -1].argmax(dim=-1, keepdim=True), tuple(self.shared.routes)

    def _forward(self, ids: torch.Tensor):
        """The model over `ids` [1, T] into the buffers, their one write index then advanced
        (layers with their own indices advance them themselves)."""
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True)
        if self._index is not None:
            self._index.add_(ids.shape[1])
        return out

    def _set_index(self, n: int) -> None:
        """Every layer of the buffers writes next at position `n`."""
        for index in ([self._index] if self._index is not None
                      else [layer.cumulative_length for layer in self.cache.layers]):
            index.fill_(n)

    def _stepped(self, tok: torch.Tensor):
        """The compiled step, its routes stacked [L, 1, k] (one kernel)."""
        nxt, routes = self.step(tok)
        return nxt, torch.stack(routes)

    def _whole_step(self):
        """The captured step: the compiled forward on `_tok`, the graph-safe listeners, the
        proposal stored at `_at` and fed back as the next step's token. Returns the routes."""
        nxt, routes = self._stepped(self._tok)
        self.shared.in_graph(routes)
        self._proposals.index_copy_(1, self._at, nxt)
        self._at.add_(1)
        self._tok.copy_(nxt)
        return routes

    def _capture_step(self) -> None:
        """Capture `_whole_step` (its warm-up compiles it; the cache's write index is put back
        after each warm-up run, whose K and V the step itself rewrites)."""
        began = time.perf_counter()
        warm = index_kept(self.cache, lambda: self.step(self._tok))
        with compiled_region(count=False), draft_step.draft_step():  # no counter's dispatch
            self.replay = self.capture(self._whole_step, warm)  # mode under the compiler
        self.captures += 1
        self.compile_s += time.perf_counter() - began
        self.compiles, self._fresh = self.compiles + 1, False

    # the captured step's own operations beside the compiled forward (`_whole_step`: the
    # routes' stack, the proposal's index_copy_, the index's add_, the token's copy_)
    WHOLE_STEP_OPS = 4

    @property
    def step_kernels(self) -> int:
        """The kernels one draft step runs on the device: the captured graph's own count where
        CUDA dumped it, else the compiled forward's (its tally, graph_kernels.py) and the
        captured step's own few operations."""
        counted = getattr(self.replay, "kernels", None)
        if counted:
            return counted
        return self.tally.kernels + self.WHOLE_STEP_OPS

    # -- the layout's interface (draft.py) --------------------------------------------------
    def start(self, target: BatchCache) -> None:
        """After the prefill: nothing copied yet (the first window copies the prompt's KV)."""
        if target.rows != 1:
            raise ValueError("the static draft step decodes one row (spec.compile=auto keeps a "
                             "batch eager)")
        self.synced = 0

    @property
    def held_bytes(self) -> int:
        """Device bytes of the static buffers (measured once, when they are made)."""
        return self._held

    def _ensure(self, target, need: int) -> None:
        """Buffers of at least `need` positions (a power of two, kept: a longer request makes
        new ones and compiles once more)."""
        from transformers import StaticCache

        if self.cache is not None and need <= self.capacity:
            return
        self.capacity = max(64, 1 << (max(need, self.positions) - 1).bit_length())
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.capacity)
        self._fresh = True
        for src, dst in zip(target.layers, self.cache.layers):
            dst.lazy_initialization(src.keys, src.values)
        self._index = one_write_index(self.cache)
        self.synced = 0
        self._held = cache_bytes(self.cache)
        self._per_position = sum(t.numel() // t.shape[2] * t.element_size()
                                 for layer in self.cache.layers for t in (layer.keys, layer.values))
        if self.capture is not None:  # the graph reads these buffers: captured again
            device = self.cache.layers[0].keys.device
            self.replay = None
            self._tok = torch.zeros(1, 1, dtype=torch.long, device=device)
            self._proposals = torch.zeros(1, self.capacity, dtype=torch.long, device=device)
            self._at = torch.zeros(1, dtype=torch.long, device=device)
            self._held += sum(t.numel() * t.element_size()
                              for t in (self._tok, self._proposals, self._at))

    def _sync(self, kv: BatchCache, k: int) -> None:
        """Copy the positions the target committed since the last window into the buffers and
        set the write index after them."""
        target, n = kv.cache, kv.length
        self._ensure(target, n + k + 1)
        s = self.synced
        if n > s:
            for src, dst in zip(target.layers, self.cache.layers):
                dst.keys[:, :, s:n].copy_(src.keys[:, :, s:n])
                dst.values[:, :, s:n].copy_(src.values[:, :, s:n])
            if self.on_copy is not None:
                self.on_copy(n - s, 1, None, nbytes=(n - s) * self._per_position)
        self._set_index(n)
        self.synced = n

    def _unseen(self, seq: list[int], k: int, kv: BatchCache) -> list[int]:
        """Before a window: the buffers hold `k` more positions, their index where the draft
        writes next. own_kv: the committed tokens the draft has not seen (the target's
        corrections; the whole prompt at the first window) and the pending token, which the
        window's first step feeds eagerly, as the eager layout takes them (empty: nothing
        unseen, the pending token is the first compiled step's). Otherwise the target's newly
        committed KV is copied in (`_sync`) and nothing is unseen."""
        if not self.own_kv:
            self._sync(kv, k)
            return []
        n = len(seq) - 1  # committed positions; the last token is pending
        self._ensure(kv.cache, n + k + 1)  # the target's layers give the shapes (same model)
        s = self.synced
        self._set_index(s)
        return seq[s:n + 1] if n > s else []

    def _catch_up(self, ids: torch.Tensor, device) -> torch.Tensor:
        """own_kv's first step, eager: the unseen tokens (`ids` [1, T], made on the host) in
        one forward into the buffers. Returns the first proposal [1, 1] on the device."""
        with self.shared.draft():
            logits = self._forward(to_device(ids, device)).logits
        self.synced += ids.shape[1] - 1
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    def steps(self, kv: BatchCache, seqs: list[list[int]], k_effs: list[int], pick,
              stop: set[int], out: list[list[int]], events, on_device: bool = False):
        """loop.py `run_steps` for one row in the static cache: the pending token first (after
        own_kv's unseen tokens), then each proposal, each step compiled (`CompiledSteps`) or
        one replay of the captured step (`capture`). Greedy only (`draft_step_form` keeps
        sampling eager): the choices stay on the device and are read once after the window's
        last step (the row drafts its whole quota, as the eager path does)."""
        if not on_device:
            raise ValueError("the compiled draft step drafts greedily; spec.compile keeps a "
                             "sampled draft eager")
        k = k_effs[0]
        unseen = self._unseen(seqs[0], k, kv)
        steps = (ReplayedSteps if self.capture is not None else CompiledSteps)(
            self, kv, seqs[0], unseen, k)
        yield from run_steps(steps, k_effs[:1], stop, out, events)

    def commit(self, n_valid: list[int]) -> None:
        """After verification: the next window copies what was committed; own_kv: the draft's
        KV of the first `n_valid` tokens is kept (the accepted proposals'), the rest rewritten."""
        if self.own_kv:
            self.synced = n_valid[0]

    def select(self, rows: list[int]) -> None:
        """One row: it leaves when the request ends."""


class CompiledSteps:
    """`StaticKV`'s steps, each one call of the compiled step (loop.py `run_steps`)."""

    def __init__(self, static: StaticKV, kv: BatchCache, seq: list[int], unseen: list[int],
                 k: int):
        self.static, self.kv, self.seq, self.unseen = static, kv, seq, unseen
        self.chosen: list[torch.Tensor] = []
        self.tok: torch.Tensor | None = None
        if unseen:  # own_kv's eager first step feeds them
            with host_side():
                self.ids = torch.tensor([unseen], dtype=torch.long)
        else:  # the pending token is the first step's input, on the device
            self.tok = self._pending()

    def _pending(self) -> torch.Tensor:
        with host_side():
            tok = torch.tensor([[self.seq[-1]]], dtype=torch.long)
        return to_device(tok, self.kv.device)

    def prepare(self, i: int, drafting):
        if i == 0 and self.unseen:  # a forward of the unseen tokens, outside the batch cache
            n = len(self.seq) - 1
            return len(self.unseen), n + 1, 1
        return 1, self.kv.length + i + 1, 1

    def run(self, i: int, drafting) -> None:
        st = self.static
        if i == 0 and self.unseen:  # own_kv: the window's first step runs eagerly
            self.tok = st._catch_up(self.ids, self.kv.device)
            self.chosen.append(self.tok)
            return None
        with st.shared.draft(), st.shared.capturing():
            began = time.perf_counter()
            with compiled_region(), draft_step.draft_step():  # one graph replay (hotpath)
                nxt, routes = st._stepped(self.tok)
            if st._fresh:  # this call compiled (host wall time, whatever the clock)
                st.compile_s += time.perf_counter() - began
                st.compiles, st._fresh = st.compiles + 1, False
            st.steps_run += 1
            with st.clock.captured_step(st.step_kernels):
                st.shared.replay(routes)
                st.clock.compiled_step()
        self.chosen.append(nxt)
        self.tok = nxt
        return None

    def read(self) -> list[list[int]]:
        return [torch.cat(self.chosen, dim=1)[0].tolist()]  # the window's one read


class ReplayedSteps(CompiledSteps):
    """`StaticKV`'s steps, each one replay of the captured step (`capture`): the window's
    first input written into the graph's token buffer (the pending token by a fill, no copy
    from the host; or own_kv's eager first proposal), then one replay per step, no other
    kernel and no host read until the window's proposals are read, once."""

    def _pending(self) -> None:
        self.static._tok.fill_(self.seq[-1])  # no copy from the host
        self.static._at.zero_()

    def prepare(self, i: int, drafting):
        """Before step i's forward is told: the first window with these buffers captures the
        step before its first replay (so no step's time holds the capture)."""
        st = self.static
        if st.replay is None and not (i == 0 and self.unseen):
            with st.shared.draft(), st.shared.capturing():
                st._capture_step()
        return super().prepare(i, drafting)

    def __init__(self, static: StaticKV, kv: BatchCache, seq: list[int], unseen: list[int],
                 k: int):
        super().__init__(static, kv, seq, unseen, k)
        self.k = k

    def run(self, i: int, drafting) -> None:
        st = self.static
        if i == 0 and self.unseen:  # own_kv: the window's first step runs eagerly
            first = st._catch_up(self.ids, self.kv.device)
            st._tok.copy_(first)
            st._proposals[:, :1].copy_(first)
            st._at.fill_(1)
            return None
        with st.shared.draft(), st.shared.capturing():
            with compiled_region(), draft_step.draft_step():  # one graph replay (hotpath;
                routes = st.replay()  # the switch as captured, where Python reruns it)
            st.steps_run += 1
            with st.clock.captured_step(st.step_kernels):
                st.shared.replay(routes, captured=True)  # read before the next replay
                st.clock.compiled_step()
        return None

    def read(self) -> list[list[int]]:
        return [self.static._proposals[0, :self.k].tolist()]  # the window's one read
