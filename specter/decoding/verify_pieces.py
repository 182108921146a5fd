"""Verification's forward in pieces: the fixed-shape stretches of each DeepSeek-V2 layer apart
from what depends on the cache's length and from the experts' host read
(`offload.verify_pieces`; the plan's next steps: docs/wip/verification-graphs.md).

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
- eager, inside `self_attn`: the cache update, `expand_kv` over the cache, the attention kernel;
- B, in the decoder layer: o_proj, the residual add, the post-attention norm;
- C, inside `mlp`: the router; eager: the routed experts; D, inside `mlp`: the shared experts and
  the sum; a dense MLP is one piece;
- eager: the residual add.

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

from specter.switch import switched


class EagerPieces:
    """Runs each piece as it is, recording the keys in order (what a capture would hold)."""

    def __init__(self):
        self.keys: list = []

    def run(self, key, fn: Callable, *inputs):
        self.keys.append(key)
        return fn(*inputs)


class CapturedPieces:
    """Each piece captured once per (key, its inputs' shapes and dtypes) as a CUDA graph by
    `capture(fn, warm)` (quant/kernels.py `capture_graph`; tests/fake_cuda.py's on the CPU)
    over static copies of its inputs, then replayed: the inputs copied in, one replay. The
    warm-up and the capture run the piece on the static inputs (a piece writes no state: no
    cache, no buffer). `replays` and `captures` count them.

    On CUDA the graphs share one memory pool (as vLLM's captured batch sizes do): a
    verification forward of width W replays its pieces in the order the first forward of
    that width captured them, and each piece's outputs are used within its layer, before any
    earlier-captured piece replays; own pools would hold at least a 2 MiB segment for each of
    a few hundred graphs (27 layers x 4 pieces x each width)."""

    def __init__(self, capture: Callable | None = None):
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
            static = [t.clone() for t in inputs]
            replay = self.capture(lambda: fn(*static), lambda: fn(*static))
            held = self.graphs[sig] = (static, replay)
            self.captures += 1
        static, replay = held
        for buffer, t in zip(static, inputs):
            buffer.copy_(t)
        self.replays += 1
        from specter.counting import compiled_region

        with compiled_region():  # one graph replay, as the draft step's (counting.py)
            return replay()


class ChargedPieces:
    """On a virtual clock: each piece runs as it is and is charged as the replay of a captured
    graph (`ComputeClock.captured_step`: one launch, the piece's kernels at the profile's
    floor, the hooks' charges inside priced as captured), its kernels counted the first time
    it runs (its launching operations: one kernel each on a GPU). The engine's counters see
    one graph replay (`compiled_region`), as for a captured draft step."""

    def __init__(self, clock):
        self.clock = clock
        self.kernels: dict = {}
        self.captures = self.replays = 0

    def run(self, key, fn: Callable, *inputs):
        from specter.counting import OpCounter, compiled_region

        sig = (key, tuple((tuple(t.shape), t.dtype) for t in inputs))
        self.replays += 1
        counter = None
        if sig not in self.kernels:
            counter, self.captures = OpCounter(), self.captures + 1

        def kernels() -> int:
            if counter is not None:
                self.kernels[sig] = sum(c["launching"] for c in counter.counts.values())
            return self.kernels[sig]
        with self.clock.captured_step(kernels), compiled_region():
            with counter if counter is not None else contextlib.nullcontext():
                return fn(*inputs)


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
        install()
        return CapturedPieces(), "captured: each fixed-shape piece a CUDA graph"
    elif timing.clock == "virtual" and cost is not None and (
            setting == "on" or cost.hw.kernel_floor_s > 0):
        install()
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


PIECES = _Pieces()


def pieces(runner):
    """Inside the block, DeepSeek-V2 layers run in pieces through `runner`."""
    return switched(PIECES, "runner", runner, runner)


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


def install() -> None:
    """Wrap transformers' DeepSeek-V2 decoder layer, attention and MoE forwards once: each
    unchanged unless `PIECES.runner` is set."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    layer_forward = ds.DeepseekV2DecoderLayer.forward
    if getattr(layer_forward, "_specter_pieces", False):
        return
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
        if isinstance(self.mlp, ds.DeepseekV2Moe):
            PIECES.layer = i  # the MoE block's pieces are this layer's
            hidden = self.mlp(hidden)
        else:
            hidden = run.run((i, "M"), self.mlp, hidden)
        return residual + hidden

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
        _, topk_weights, topk_indices = run.run((i, "C"), self.gate, hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        routed = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return run.run((i, "D"), lambda r, x: r + self.shared_experts(x), routed, residuals)

    for f in (decoder_layer, attention, moe):
        f._specter_pieces = True
    decoder_layer.__wrapped__ = layer_forward
    attention.__wrapped__ = attn_forward
    moe.__wrapped__ = moe_forward
    ds.DeepseekV2DecoderLayer.forward = decoder_layer
    ds.DeepseekV2Attention.forward = attention
    ds.DeepseekV2Moe.forward = moe
