"""Resident's decode step as one compiled graph, over a static cache: the fair baseline of a
compiled draft step (every system that decodes one token at a time may compile that step).

Owns: `CompiledDecode`, batch-1 greedy decoding whose decode steps (a token id on the device ->
every layer with every routed expert resident -> logits -> the greedy token, left on the
device) run as one graph under `torch.compile(fullgraph=True, dynamic=False)`, and the
fixed-shape experts function (the target seat of specter/experts.py while the step runs)
that makes the step one graph: Hugging Face's experts loop reads
the routing on the host (which experts have tokens), a graph break. At one token the layer's
k experts are its k chosen ones, so the function runs exactly k expert MLPs in expert-id
order (the k ids sorted on the device), each on the weights indexed by a device tensor, each
weighted and added as HF's loop adds them: the same operations in the same order, so the
tokens are the resident model's (tests/test_compiled_decode.py checks them against
`generate`). `resolve_system_compile` (`system.compile=auto|on|off`).

The prompt is prefilled eagerly (HF's own experts; its length varies) into a dynamic cache
whose keys and values are then copied into the static buffers, sized once for the run
(`positions`) so that one compilation serves every request.
Does not own: the eager greedy loop (batch.py), the draft's compiled step (compiled_draft.py).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from specter.clock.graph_kernels import KernelTally
from specter.clock.kinds import ClockKind
from specter.clock.observer import NULL_CLOCK, NullClock
from specter.counting import compiled_region
from specter.decoding.batch import BatchCache, Generation, cache_bytes
from specter.decoding.compiled_draft import index_kept
from specter.quant.step_form import settle_compile
from specter.decoding.loop import Events
from specter.experts import experts_of
from specter.offload.mlp import expert_mlp

def _fixed_shape_experts(owner, layer, self, hidden_states, top_k_index, top_k_weights):
    """One token's routed experts with no host read: hidden [1, H], top_k_* [1, k]. HF's loop
    visits the chosen experts in ascending id, computes each on its token and adds it to a
    zero sum; here the same k MLPs in the same order (`sort` on the device)."""
    if not owner.active or hidden_states.shape[0] != 1:
        return owner.eager(layer, self, hidden_states, top_k_index, top_k_weights)
    owner.routes.append(top_k_index)  # an output of the step (a virtual clock's charge)
    experts, slots = torch.sort(top_k_index[0])  # distinct ids: the order is HF's
    final = torch.zeros_like(hidden_states)
    row = torch.zeros(1, dtype=torch.long, device=hidden_states.device)
    for j in range(top_k_index.shape[1]):
        e = experts[j:j + 1]  # [1]: an index tensor (a 0-d one would be read as an int)
        gate_up, down = self.gate_up_proj.index_select(0, e)[0], self.down_proj.index_select(0, e)[0]
        y = expert_mlp(hidden_states, gate_up, down, self._apply_gate)
        y = y * top_k_weights.index_select(1, slots[j:j + 1])  # [1, 1], as HF's [n, 1]
        final.index_add_(0, row, y.to(final.dtype))
    return final


def resolve_system_compile(setting: str, rows: int, clock: ClockKind,
                           sampling: bool = False) -> tuple[bool, str]:
    """(compiled, why) for resident's `system.compile`: one greedy row; not the emulated clock (it
    sleeps in hooks a graph does not run). `auto` compiles on a real clock (the CPU's, or a
    GPU's, where the step is captured as one CUDA graph); on a virtual clock it stays eager,
    as the paper's resident, and `on` charges the step as a captured graph (as a compiled
    draft step is)."""
    if setting == "auto" and clock.charged:
        return False, ("eager: on a virtual clock auto stays eager, as the paper's resident "
                       "(system.compile=on charges the step as a captured graph)")
    reasons = []
    if rows != 1:
        reasons.append(f"a batch of {rows} rows (the static step decodes one row)")
    if sampling:
        reasons.append("sampling draws each token on the host (the static step picks greedily)")
    if clock.sleeps:
        reasons.append(f"the {clock.name} clock charges each forward from hooks a compiled graph "
                       "does not run (use a real clock: hardware=cpu or a CUDA device)")
    return settle_compile("system.compile", setting, "resident's decode step", reasons)


class CompiledDecode:
    """Batch-1 greedy decoding with each decode step one compiled graph (module docstring).
    `compiler`: torch.compile's backend ("eager": the graph checked, no code generated);
    `positions`: the longest context a request reaches (prompt and new tokens), so one set of
    buffers serves the run; `capture`: below."""

    def __init__(self, model: nn.Module, compiler: str = "inductor", positions: int = 0,
                 capture=None, clock: NullClock = NULL_CLOCK):
        self.model, self.compiler = model, compiler
        self.positions = positions
        # capture(fn, warm) -> replay(): on CUDA `quant.kernels.capture_graph`, the draft's
        # (compiled_draft.py): the whole step (the compiled forward, the argmax, the token fed
        # back) one CUDA graph, captured at the first step with these buffers (the runner's
        # untimed warm-up request) and replayed per step; None: the compiled step called
        self.capture = capture
        self.replay = None
        self.captures = 0
        self._tok: torch.Tensor | None = None  # the captured step's token buffer [1, 1]
        self.active = False
        # the target seat of the model's experts dispatcher (specter/experts.py): the
        # fixed-shape function while a compiled step runs, the target before it otherwise
        # (HF's loop: the prefill's)
        experts = experts_of(model)
        self.eager = experts.target
        experts.target = lambda layer, module, hidden_states, top_k_index, top_k_weights: \
            _fixed_shape_experts(self, layer, module, hidden_states, top_k_index, top_k_weights)
        self.cache = None
        self.capacity = 0
        self.routes: list[torch.Tensor] = []
        # the engine's clock (clock/observer.py): each compiled step charged after it runs, as
        # a captured graph's replay (a no-op on real clocks)
        self.clock = clock
        torch._dynamo.reset()  # one compiled decoder at a time (see StaticKV)
        self.tally = KernelTally()  # the compiled step's kernels (graph_kernels.py)
        self.step = torch.compile(self._step, fullgraph=True, dynamic=False,
                                  backend=self.tally.backend(compiler))
        self.steps_run = self.compiles = 0
        self.compile_s = 0.0
        self._fresh = False

    def _step(self, tok: torch.Tensor):
        """tok [1, 1] -> (the greedy next token [1, 1], routes [L, 1, k]) on the device; K and
        V written at the cache's index, which advances by one."""
        self.routes = []
        out = self.model(input_ids=tok, cache=self.cache, use_cache=True)
        return out.logits[:, -1].argmax(dim=-1, keepdim=True), torch.stack(self.routes)

    def _whole_step(self) -> torch.Tensor:
        """The captured step: the compiled forward on `_tok`, its greedy token written back into
        `_tok` (the next step's input). Returns the routes."""
        nxt, routes = self.step(self._tok)
        self._tok.copy_(nxt)
        return routes

    def _capture_step(self) -> None:
        """Capture `_whole_step`; its warm-up runs compile the step, and the cache's write index
        is put back after each (the step itself rewrites their K and V)."""
        began = time.perf_counter()
        warm = index_kept(self.cache, lambda: self.step(self._tok))
        self.active = True
        try:
            with compiled_region(count=False):  # no counter's dispatch mode under the compiler
                self.replay = self.capture(self._whole_step, warm)
        finally:
            self.active = False
        self.captures += 1
        self.compile_s += time.perf_counter() - began
        self.compiles, self._fresh = self.compiles + 1, False

    def _run_step(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step from `tok` [1, 1] on the device: a replay of the captured graph
        (`_tok` is its input and output), or a call of the compiled step."""
        if self.capture is not None:
            if tok is not self._tok:  # the request's first step: the prefill's token
                self._tok.copy_(tok)
            if self.replay is None:
                self._capture_step()
        self.active = True  # (a replay runs no Python on a GPU; a stand-in's runs the step)
        try:
            with compiled_region():  # one graph replay, or one compiled call (hotpath.py)
                if self.capture is None:
                    return self.step(tok)
                return self._tok, self.replay()
        finally:
            self.active = False

    def _load(self, dynamic, n: int) -> None:
        """The buffers (made once, or larger for a longer request) with the prompt's KV."""
        from transformers import StaticCache

        if self.cache is None or n > self.capacity:
            self.capacity = max(64, 1 << (max(n, self.positions) - 1).bit_length())
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.capacity)
            for src, dst in zip(dynamic.layers, self.cache.layers):
                dst.lazy_initialization(src.keys, src.values)
            self._fresh = True
            if self.capture is not None:  # the graph reads these buffers: captured again
                self.replay = None
                self._tok = torch.zeros(1, 1, dtype=torch.long,
                                        device=self.cache.layers[0].keys.device)
        for src, dst in zip(dynamic.layers, self.cache.layers):  # later positions: masked
            dst.keys[:, :, :src.keys.shape[2]].copy_(src.keys)
            dst.values[:, :, :src.values.shape[2]].copy_(src.values)
            dst.cumulative_length.fill_(src.keys.shape[2])

    def generate(self, prompt: list[int], max_new_tokens: int, device: torch.device, timeline,
                 stop: set[int], memory, events=None, on_commit=None) -> Generation:
        """loop.py `greedy_decode_batch` for one request, its decode steps compiled (each told to
        `events` as a forward of one token); `on_commit`
        hears each token (`[token]`) as it is committed, after the stop check's host read
        (the compiled step is unchanged)."""
        if not prompt:
            raise ValueError("every request needs at least one prompt token")
        events = events or Events()
        memory.start()
        kv = BatchCache(self.model, device, 1)
        start = timeline.mark()
        events.forward("prefill", *kv.shape([list(prompt)]))
        logits = kv.forward([list(prompt)])
        tok = logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1] on the device
        tokens, times = [], []
        n = len(prompt)
        self._load(kv.cache, n + max_new_tokens)
        kv = None  # the dynamic cache is not read again
        while True:
            picked = tok[0, 0].tolist()  # host read: the stop check (as the eager loop's)
            tokens.append(picked)
            times.append(timeline.mark())
            heard = on_commit is None or on_commit([picked]) is not False  # False: it ends
            memory.observe_cache(None, cache_bytes(self.cache))
            if len(tokens) >= max_new_tokens or picked in stop or not heard:
                break
            events.forward("decode", 1, n + 1, 1)  # a step outside the cache
            began = time.perf_counter()
            tok, routes = self._run_step(tok)
            with self.clock.captured_step(self.tally.kernels):
                self.clock.compiled_step(routes)
            if self._fresh:
                self.compile_s += time.perf_counter() - began
                self.compiles, self._fresh = self.compiles + 1, False
            self.steps_run += 1
            n += 1
        peak, source = memory.peak()
        return Generation(tokens=tokens, commit_times_s=[timeline.timestamp(m) for m in times],
                          start_time_s=timeline.timestamp(start), peak_mem_bytes=peak,
                          peak_mem_source=source)
