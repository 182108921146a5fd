"""Verification's forward in pieces: the fixed-shape stretches of each DeepSeek-V2 layer apart
from what depends on the cache's length and from the experts' host read
(`offload.verify_pieces`; what it brought: docs/measurements/verification-launches-2026-12-07.md).

A verification forward of width W runs, per layer, transformers' own kernels in transformers'
order. Only two things in a layer change shape or need the host: attention over the growing
cache, and the routed experts (the offload runtime reads the routing). Everything else has
the same shapes at every window of width W, so a CUDA graph captured once per (layer, piece, W)
replays exactly those kernels: bitwise the eager output, one launch instead of dozens.

This module runs a layer as those pieces (`PIECES.runner`, None: transformers' forwards
untouched), calling the same submodules and operations in the same order, inside the same
module calls (so every forward hook, the clock's included, fires as before):

- A, in the decoder layer before `self_attn(...)`: the input norm, the q and kv_a projections,
  the KV latent's norm, the rotary embedding, the query's concatenation;
- eager, inside `self_attn`: the cache update, then `expand_kv` over the cache and the
  attention as one op, `specter::mla_attend` (one Triton kernel on CUDA, models/
  triton_verify.py; transformers' operations on the CPU);
- B, in the decoder layer: o_proj, the residual add, the post-attention norm;
- C, inside `mlp`: the router; eager: the routed experts; D, inside `mlp`: the shared experts and
  the sum; a dense MLP is one piece;
- eager: the residual add;
and outside the layers (`mark`): the rotary embedding of the window's positions, and the final
norm, one piece each.

A runner's `run(key, fn, *inputs)` returns `fn(*inputs)`: `EagerPieces` calls it (the layout,
bitwise transformers' forward); `CapturedPieces` captures each piece once per shape as a CUDA
graph and replays it (its inputs copied into the graph's static buffers); `ChargedPieces`, on
a virtual clock, runs it and charges it as a captured graph. `pieces_for` picks one for an
engine; the batch cache (decoding/batch.py) runs its verification forwards through it.
tests/test_verify_pieces.py holds the bitwise equality, the counts and the runner's tokens.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.nn import functional as F

from specter.switch import switched


class EagerPieces:
    """Runs each piece as it is, recording the keys in order (what a capture would hold)."""

    def __init__(self):
        self.keys: list = []

    def run(self, key, fn: Callable, *inputs):
        self.keys.append(key)
        return fn(*inputs)


def copy_into(static, fresh) -> None:
    """`fresh` results copied into `static` outputs of the same structure (tensors, in tuples
    and lists): a graph's outputs stay where its first run put them."""
    if isinstance(static, torch.Tensor):
        with torch.no_grad():
            static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for a, b in zip(static, fresh):
            copy_into(a, b)


def _storages(out) -> set[int]:
    """The storages of a piece's output tensors (in tuples and lists)."""
    if isinstance(out, torch.Tensor):
        return {out.untyped_storage().data_ptr()}
    if isinstance(out, (tuple, list)):
        return set().union(*(_storages(o) for o in out)) if out else set()
    return set()


class _Statics:
    """A runner's static inputs: each piece's input is a buffer, copied into before each
    replay (one copy kernel each), except where it is already there:
    - (a view of) an earlier piece's output, which stays where that piece's graph writes it
      (a graph's outputs are static): the piece reads it in place, as vLLM's captured layers
      read the previous one's output;
    - a tensor an earlier piece's buffer already holds (the same tensor, not written since:
      its `_version`; e.g. the rotary embedding every layer reads): that buffer is the piece's
      too, filled once."""

    def __init__(self):
        self.outputs: set[int] = set()  # the storages of the pieces' (static) outputs
        self.holds: dict[int, tuple] = {}  # id(buffer) -> (the tensor copied in, its version)
        self.buffer_of: dict[tuple, torch.Tensor] = {}  # the tensor's place -> a buffer of it
        self.copies = 0  # input copies issued

    @staticmethod
    def _place(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

    def _holding(self, buffer: torch.Tensor, t: torch.Tensor) -> bool:
        held = self.holds.get(id(buffer))
        return held is not None and held[0] is t and held[1] == t._version

    def chained(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.outputs

    def statics(self, inputs) -> list[torch.Tensor]:
        """Static inputs for a new capture: an earlier piece's output as it is, a buffer
        already holding the tensor, else a clone (its own buffer)."""
        out = []
        for t in inputs:
            if self.chained(t):
                out.append(t)
                continue
            buffer = self.buffer_of.get(self._place(t))
            if buffer is None or not self._holding(buffer, t):
                buffer = t.clone()
                self.buffer_of[self._place(t)] = buffer
                self.holds[id(buffer)] = (t, t._version)
            out.append(buffer)
        return out

    def fill(self, static, inputs) -> None:
        """Before a replay: each input not already where the piece reads it copied in."""
        for buffer, t in zip(static, inputs):
            if buffer.data_ptr() == t.data_ptr() and buffer.stride() == t.stride():
                continue  # an earlier piece's output, read in place
            if self._holding(buffer, t):
                continue  # copied in already for an earlier piece
            buffer.copy_(t)
            self.holds[id(buffer)] = (t, t._version)
            self.copies += 1

    def produced(self, out) -> None:
        self.outputs |= _storages(out)


class CapturedPieces(_Statics):
    """Each piece captured once per (key, its inputs' shapes and dtypes) as a CUDA graph by
    `capture(fn, warm)` (quant/kernels.py `capture_graph`; tests/fake_cuda.py's on the CPU)
    over static inputs (`_Statics`: copied in, or an earlier piece's output read in place),
    then replayed. The warm-up and the capture run the piece on the static inputs (a piece
    writes no state: no cache, no buffer). `replays`, `captures` and `copies` count them.

    On CUDA the graphs share one memory pool (as vLLM's captured batch sizes do): a
    verification forward of width W replays its pieces in the order the first forward of
    that width captured them, and each piece's outputs are used within its layer, before any
    earlier-captured piece replays; own pools would hold at least a 2 MiB segment for each of
    a few hundred graphs (27 layers x 4 pieces x each width)."""

    def __init__(self, capture: Callable | None = None):
        super().__init__()
        if capture is None:
            import functools

            from specter.quant.kernels import capture_graph
            capture = functools.partial(capture_graph, pool=torch.cuda.graph_pool_handle())
        self.capture = capture
        self.graphs: dict = {}
        self.captures = self.replays = 0

    def run(self, key, fn: Callable, *inputs):
        sig = (key, tuple((tuple(t.shape), t.dtype) for t in inputs))
        held = self.graphs.get(sig)
        if held is None:
            static = self.statics(inputs)
            replay = self.capture(lambda: fn(*static), lambda: fn(*static))
            held = self.graphs[sig] = (static, replay)
            self.captures += 1
        static, replay = held
        self.fill(static, inputs)
        self.replays += 1
        from specter.counting import compiled_region, graph_kernels

        with compiled_region():  # one graph replay, as the draft step's (counting.py)
            out = replay()
        if getattr(replay, "kernels", None) is not None:
            graph_kernels(replay.kernels)
        self.produced(out)
        return out


class ChargedPieces(_Statics):
    """On a virtual clock: each piece runs as it is and is charged as the replay of a captured
    graph (`ComputeClock.captured_step`: one launch, the piece's kernels at the profile's
    floor, the hooks' charges inside priced as captured), its kernels counted the first time
    it runs (its launching operations: one kernel each on a GPU). The engine's counters see
    one graph replay (`compiled_region`), as for a captured draft step. Its inputs go through
    static buffers as `CapturedPieces`' do (`_Statics`): the copies a GPU would issue are
    issued here too, eagerly, so the clock charges them as it charges any eager kernel; each
    piece's outputs stay where its first run put them (later runs copied into them, not
    counted), as a graph's outputs do."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.kernels: dict = {}
        self.static: dict = {}
        self.held: dict = {}
        self.captures = self.replays = 0

    def run(self, key, fn: Callable, *inputs):
        from specter.counting import OpCounter, compiled_region, graph_kernels

        sig = (key, tuple((tuple(t.shape), t.dtype) for t in inputs))
        self.replays += 1
        counter = None
        if sig not in self.kernels:
            counter, self.captures = OpCounter(), self.captures + 1
            self.static[sig] = self.statics(inputs)
        static = self.static[sig]
        self.fill(static, inputs)

        def kernels() -> int:
            if counter is not None:
                self.kernels[sig] = sum(c["launching"] for c in counter.counts.values())
            return self.kernels[sig]
        with self.clock.captured_step(kernels), compiled_region():
            with counter if counter is not None else contextlib.nullcontext():
                out = fn(*static)
            if sig in self.held:  # the outputs stay where the first run put them, as a graph's
                copy_into(self.held[sig], out)
            else:
                self.held[sig] = out
        graph_kernels(kernels())
        out = self.held[sig]
        self.produced(out)
        return out


def pieces_for(job, timing, clock):
    """(runner or None, the record's `verify_pieces`) for a speculative engine's verification
    (`offload.verify_pieces`): captured on CUDA; on a virtual clock charged as captured where
    its profile charges a kernel floor (auto) or always (on); else eager, saying why. `on`
    refuses in one sentence where it cannot run."""
    from specter.errors import UserError

    setting = job.offload.verify_pieces
    if setting == "off":
        return None, "off"
    arch = getattr(job.loaded.model.config, "model_type", "?")
    cost = getattr(timing, "cost", None)
    if arch != "deepseek_v2":
        why = f"{arch} verifies eagerly (pieces are written for deepseek_v2)"
    elif job.device.type == "cuda":
        install(job.loaded.model)
        return CapturedPieces(), "captured: each fixed-shape piece a CUDA graph"
    elif timing.charged and (
            setting == "on" or cost.hw.kernel_floor_s > 0):
        install(job.loaded.model)
        return ChargedPieces(clock), "charged as captured (virtual clock)"
    else:
        why = (f"no CUDA graph on {job.device.type}, and the {timing.clock} clock's profile "
               "charges no kernel floor")
    if setting == "on":
        raise UserError(f"offload.verify_pieces=on cannot run here: {why}.")
    return None, f"eager: {why}"


class _Pieces:
    runner = None
    layer = None  # the decoder layer whose MoE block runs
    residual = None  # its residual, added after the block (inside piece D)


PIECES = _Pieces()


def pieces(runner):
    """Inside the block, DeepSeek-V2 layers run in pieces through `runner`."""
    return switched(PIECES, "runner", runner, runner)


def _moe_routed(moe, runtime, run, i: int, hidden_states):
    """A DeepSeek-V2 MoE block over the offload runtime in two pieces around its experts call:
    C, the router and everything of the routing that has fixed shapes (its grouping on the
    device and the sum's tensors: grouping.route_order, LayerSum.make), handed to the call
    (`runtime.routed`), which then reads the groups' counts, copies, and computes in rounds;
    D, the products summed rank by rank (`sum_ranks`), the shared experts, the sum and the
    decoder layer's residual add. The same operations in transformers' and the runtime's
    order: bitwise the eager forward."""
    from specter.grouping import route_order
    from specter.offload.grouped import LayerSum, sum_ranks
    from specter.offload.runtime import Routed

    orig_shape, num_experts = hidden_states.shape, runtime.cache.store.layout.num_experts

    def c(h):
        _, weights, index = moe.gate(h)
        counts, pos, token = route_order(index, num_experts)
        made = LayerSum.make(h.view(-1, h.shape[-1]), index, pos, token, weights)
        return (weights, index, counts, pos, token, *made)
    weights, index, counts, pos, token, *made = run.run((i, "C"), c, hidden_states)
    routed = runtime.routed = Routed(index, counts, pos, token, tuple(made))
    out = moe.experts(hidden_states.view(-1, hidden_states.shape[-1]), index, weights)
    runtime.routed = None  # (taken by the call, or not wanted)
    k = index.shape[1]

    def d(parts, x, res):
        summed = sum_ranks(parts, k) if routed.deferred else parts
        return res + (summed.view(*orig_shape) + moe.shared_experts(x))
    return run.run((i, "D"), d, out, hidden_states, PIECES.residual)


def _attention_pre(attn, hidden_states, position_embeddings):
    """transformers' DeepseekV2Attention.forward up to the cache update, as it is written."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, attn.qk_head_dim)
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(query_shape).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    compressed_kv = attn.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_pe = torch.split(compressed_kv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_nope = attn.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, attn.kv_lora_rank)
    k_pe = k_pe.view(batch_size, 1, seq_length, attn.qk_rope_head_dim)
    q_pe, k_pe = ds.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    return query_states, k_nope, k_pe


# -- attention over the cache as one op ----------------------------------------------------------
def _attend_torch(query, kv_nope, k_pe, kv_b, mask, scaling, nope, v_dim):
    """transformers' DeepSeek-V2 attention after the cache update, as it is written:
    `expand_kv` (kv_b_proj over every cached latent, the key's assembly), then the SDPA
    interface (a module without key-value groups, causal), then the layout [B, W, H DV]."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch_size, _, seq_length, _ = kv_nope.shape
    kv = F.linear(kv_nope, kv_b).view(batch_size, seq_length, -1, nope + v_dim).transpose(1, 2)
    k_nope, value_states = torch.split(kv, [nope, v_dim], dim=-1)
    k_rot = k_pe.expand(-1, k_nope.shape[1], -1, -1)
    key_states = kv.new_empty(*kv.shape[:-1], nope + k_pe.shape[-1])
    key_states[..., :nope].copy_(k_nope)
    key_states[..., nope:].copy_(k_rot)
    out, _ = sdpa_attention_forward(SimpleNamespace(is_causal=True), query, key_states,
                                    value_states, mask, dropout=0.0, scaling=scaling)
    return out.reshape(query.shape[0], query.shape[2], -1).contiguous()


def _attend_launch(query, kv_nope, k_pe, kv_b, mask, scaling, nope, v_dim):
    """One launch of triton_verify.mla_verify (a program per row and head)."""
    import triton

    from specter.counting import launched
    from specter.quant.kernels import _kernel, interpret_mode

    B, H, W, _ = query.shape
    L, R, DR = kv_nope.shape[2], kv_nope.shape[3], k_pe.shape[3]
    if mask is None and W > 1:
        # SDPA's own causal alignment (transformers crops the keys): not this kernel's
        return _attend_torch(query, kv_nope, k_pe, kv_b, mask, scaling, nope, v_dim)
    if query.stride(3) != 1 or kv_nope.stride(3) != 1 or k_pe.stride(3) != 1 \
            or not kv_b.is_contiguous():
        raise ValueError("mla_attend: rows must be contiguous")
    out = torch.empty(B, W, H * v_dim, dtype=query.dtype, device=query.device)
    if mask is not None:  # [B or 1, 1, W, L], any strides (a broadcast row: stride 0)
        m = mask.expand(B, 1, W, L)
        m_args, has_mask = (m, m.stride(0), m.stride(2), m.stride(3)), True
    else:
        m_args, has_mask = (query, 0, 0, 0), False
    p2 = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731
    launched("triton")
    _kernel("mla_verify", "specter.models.triton_verify")[(B, H)](
        query, kv_nope, k_pe, kv_b, m_args[0], out, W, L, float(scaling), query.stride(0),
        query.stride(1), query.stride(2), kv_nope.stride(0), kv_nope.stride(2),
        k_pe.stride(0), k_pe.stride(2), *m_args[1:], out.stride(0), out.stride(1),
        R=R, DN=nope, DR=DR, DV=v_dim, BLOCK_W=p2(W), BLOCK_L=32, BLOCK_R=64,
        BLOCK_DN=p2(nope), BLOCK_DR=p2(DR), BLOCK_DV=p2(v_dim), HAS_MASK=has_mask,
        MASK_BOOL=has_mask and mask.dtype == torch.bool,
        IEEE_DOT=query.dtype == torch.float32, UPCAST=interpret_mode())
    return out


@torch.library.custom_op("specter::mla_attend", mutates_args=())
def mla_attend(query: torch.Tensor, kv_nope: torch.Tensor, k_pe: torch.Tensor,
               kv_b: torch.Tensor, mask: torch.Tensor | None, scaling: float, nope: int,
               v_dim: int, use_triton: bool) -> torch.Tensor:
    """A verification window's DeepSeek-V2 attention over the updated cache: the queries
    [B, H, W, nope + rope], the cache's latents [B, 1, L, R] and rotary keys [B, 1, L, rope],
    kv_b_proj's weight, the mask -> [B, W, H v_dim]. `use_triton`: one launch
    (models/triton_verify.py, CUDA or the interpreter); else transformers' operations."""
    if use_triton:
        from specter.quant.kernels import fused_or_torch

        return fused_or_torch("mla_attend", True, _attend_launch, _attend_torch, query,
                              kv_nope, k_pe, kv_b, mask, scaling, nope, v_dim)
    return _attend_torch(query, kv_nope, k_pe, kv_b, mask, scaling, nope, v_dim)


@mla_attend.register_fake
def _(query, kv_nope, k_pe, kv_b, mask, scaling, nope, v_dim, use_triton):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1] * v_dim)


def _one_op(attn, kwargs) -> bool:
    """Whether this attention call is what `mla_attend` computes: SDPA, no key-value groups,
    kv_b_proj without a bias, inference, no option the op does not take."""
    return (attn.config._attn_implementation == "sdpa" and not attn.training
            and getattr(attn, "num_key_value_groups", 1) == 1
            and attn.kv_b_proj.bias is None
            and not any(kwargs.get(k) for k in ("softcap", "output_attentions", "is_causal",
                                                 "position_bias")))


def mark(model) -> None:
    """The forward's own pieces outside the layers, on `model` (a DeepSeek-V2 causal LM): the
    rotary embedding of the window's positions (unless its rope type updates its state as the
    sequence grows: dynamic, longrope) and the final norm, each one piece."""
    inner = getattr(model, "model", None)
    rope = getattr(inner, "rotary_emb", None)
    if rope is not None and not any(t in str(getattr(rope, "rope_type", ""))
                                    for t in ("dynamic", "longrope")):
        rope._specter_piece = ("rope",)
    if getattr(inner, "norm", None) is not None:
        inner.norm._specter_piece = ("norm",)


_INSTALLED: list = []


def install(model=None) -> None:
    """Wrap transformers' DeepSeek-V2 decoder layer, attention, MoE, RMSNorm and rotary
    forwards once: each unchanged unless `PIECES.runner` is set (the norm and the rotary
    embedding: unless also `mark`ed, which `model` is)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    if model is not None:
        mark(model)
    if _INSTALLED:  # (once: another patch, the draft step's, may wrap these since)
        return
    _INSTALLED.append(True)
    layer_forward = ds.DeepseekV2DecoderLayer.forward
    norm_forward = ds.DeepseekV2RMSNorm.forward
    rope_forward = ds.DeepseekV2RotaryEmbedding.forward
    attn_forward = ds.DeepseekV2Attention.forward
    moe_forward = ds.DeepseekV2Moe.forward

    def decoder_layer(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                      use_cache=False, position_embeddings=None, **kwargs):
        run = PIECES.runner
        if run is None:
            return layer_forward(self, hidden_states, attention_mask=attention_mask,
                                 position_ids=position_ids, cache=cache, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        i = self.self_attn.layer_idx
        query, k_nope, k_pe = run.run(
            (i, "A"), lambda h, pe: _attention_pre(self.self_attn, self.input_layernorm(h), pe),
            hidden_states, position_embeddings)
        attn_output, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache,
            position_embeddings=position_embeddings, _specter_pieces=(query, k_nope, k_pe),
            **kwargs)

        def b(a, residual):
            hidden = residual + self.self_attn.o_proj(a)
            return hidden, self.post_attention_layernorm(hidden)
        residual, hidden = run.run((i, "B"), b, attn_output, hidden_states)
        # the layer's last residual add runs inside its last piece (D, or M): the layer's
        # output is a piece's, which the next layer's first piece reads in place
        if isinstance(self.mlp, ds.DeepseekV2Moe):
            PIECES.layer, PIECES.residual = i, residual  # the MoE block's pieces are this layer's
            try:
                return self.mlp(hidden)
            finally:
                PIECES.residual = None
        return run.run((i, "M"), lambda h, res: res + self.mlp(h), hidden, residual)

    def attention(self, *args, _specter_pieces=None, **kwargs):
        if _specter_pieces is None:
            return attn_forward(self, *args, **kwargs)
        query_states, k_nope, k_pe = _specter_pieces
        hidden_states = kwargs.pop("hidden_states")
        attention_mask = kwargs.pop("attention_mask", None)
        cache = kwargs.pop("cache", None)
        kwargs.pop("position_embeddings", None)
        batch_size, seq_length = hidden_states.shape[:-1]
        if cache is not None:
            k_nope, k_pe = cache.update(k_nope, k_pe, self.layer_idx, kwargs=kwargs)
        if _one_op(self, kwargs):  # the rest of it one op (one kernel on a GPU)
            from specter.quant.kernels import triton_available

            out = torch.ops.specter.mla_attend(
                query_states, k_nope, k_pe, self.kv_b_proj.weight, attention_mask,
                self.scaling, self.qk_nope_head_dim, self.v_head_dim,
                query_states.device.type == "cuda" and triton_available())
            return out, None
        key_states, value_states = self.expand_kv(k_nope, k_pe)
        interface = ds.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, ds.eager_attention_forward)
        attn_output, attn_weights = interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs)
        # o_proj runs in piece B, beside the residual add and the next norm
        return attn_output.reshape(batch_size, seq_length, -1).contiguous(), attn_weights

    def moe(self, hidden_states):
        run = PIECES.runner
        if run is None:
            return moe_forward(self, hidden_states)
        i = PIECES.layer
        residuals = hidden_states
        orig_shape = hidden_states.shape
        runtime = getattr(getattr(self.experts, "_specter_experts", None), "runtime", None)
        if runtime is not None and runtime.takes_routed:
            return _moe_routed(self, runtime, run, i, hidden_states)
        _, topk_weights, topk_indices = run.run((i, "C"), self.gate, hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        routed = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        # (the decoder layer's residual add after the block, as transformers orders it)
        return run.run((i, "D"), lambda r, x, res: res + (r + self.shared_experts(x)), routed,
                       residuals, PIECES.residual)

    def norm(self, hidden_states):
        key, run = getattr(self, "_specter_piece", None), PIECES.runner
        if key is None or run is None:
            return norm_forward(self, hidden_states)
        return run.run(key, lambda h: norm_forward(self, h), hidden_states)

    def rope(self, x, position_ids):
        key, run = getattr(self, "_specter_piece", None), PIECES.runner
        if key is None or run is None:
            return rope_forward(self, x, position_ids)
        # x gives the device only: the positions are the piece's one input
        return run.run(key, lambda p: rope_forward(self, x, p), position_ids)

    patched = ((ds.DeepseekV2DecoderLayer, decoder_layer, layer_forward),
               (ds.DeepseekV2Attention, attention, attn_forward),
               (ds.DeepseekV2Moe, moe, moe_forward),
               (ds.DeepseekV2RMSNorm, norm, norm_forward),
               (ds.DeepseekV2RotaryEmbedding, rope, rope_forward))
    for cls, f, orig in patched:
        f._specter_pieces = True
        f.__wrapped__ = orig
        cls.forward = f
