"""The compiled draft step's own formulations of DeepSeek-V2's layers: fewer kernels, same math.

A captured draft step runs its kernels back to back, each costing at least a few
microseconds on the device (docs/clocks.md, "The kernel floor"), so the step is worth writing
for the compiler where transformers' eager code costs kernels that no fusion removes:

- the rotary embedding: transformers rotates the query's and key's rotary part in complex
  arithmetic (`apply_rotary_emb`: view_as_complex, a complex multiply, view_as_real). The
  compiler cannot generate code for complex tensors: each complex multiply stays a library
  call and each view a copy. Here the same rotation in real arithmetic, pair (x0, x1) by
  (cos, sin) -> (x0 cos - x1 sin, x0 sin + x1 cos): pointwise, fused with its neighbours.
- the router: transformers' greedy top-k router is its GEMM (in fp32: the weight converted
  each step), a softmax and a top-k, which the compiler makes six kernels or more. Here one
  custom op (`specter::route_topk`): on CUDA one Triton kernel a token (quant/triton_moe.py
  `route_topk`: the GEMM, as vLLM's fused top-k softmax after it); elsewhere transformers' own
  router in torch. The experts come largest first (transformers' order is unspecified:
  sorted=False).
- the attention: transformers' DeepSeek-V2 attention after its projections (the latent's
  norm, the rotations, the cache writes, kv_b_proj over every cached position, the key's and
  the query's assembly, the products and the softmax: about ten kernels) as one custom op
  (`specter::mla_decode`): on CUDA one Triton launch (models/triton_draft.py: the cache
  written, and attention computed absorbed over the latent, as DeepSeek's own decoder does);
  elsewhere transformers' formulation in torch. It runs where the draft's static cache has
  one write index (compiled_draft.one_write_index) and a step feeds one token.
- GEMMs of one input: q (or q_a) with kv_a, and each MLP's gate with up, multiplied as one
  (`merge_projections` makes the pairs views of one weight: no byte added, the target's own
  GEMMs unchanged).

Counted by experiments.kernel_count (DeepSeek-V2-Lite's depth; docs/clocks.md). The absorbed
attention written in torch ops counted the same as transformers' on the CPU; it pays as a
kernel of its own (the op above).

Only the compiled draft step uses these (`compiled_draft.StaticKV` turns `DRAFT_STEP` on around
its steps and its capture; the compiler guards on the switch): the target, its verification
and every eager path keep transformers' own code, so the output stays the target's bit for
bit. The draft rounds differently in the last bits; a draft only proposes.
"""

from __future__ import annotations

import torch
from typing import NamedTuple

from torch.nn import functional as F

from specter.quant.kernels import fused_or_torch
from specter.switch import switched


class _Switch:
    on = False


DRAFT_STEP = _Switch()


def draft_step():
    """Inside the block, DeepSeek-V2's layers run this module's formulations."""
    return switched(DRAFT_STEP, "on", True)


def rotate_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] (interleaved pairs, DeepSeek's complex layout) rotated by cos, sin
    [..., d/2] (broadcast), in float32, returned in x's dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


# -- the router as one op ----------------------------------------------------------------------
def _route_topk_torch(x: torch.Tensor, weight: torch.Tensor, k: int, scale: float):
    """transformers' greedy router: the GEMM in fp32, the softmax, the top k."""
    logits = F.linear(x.float(), weight.float())
    probs = torch.softmax(logits, dim=-1)
    weights, index = torch.topk(probs, k, dim=-1, sorted=True)
    return logits, weights * scale, index


def _route_topk_launch(x: torch.Tensor, weight: torch.Tensor, k: int, scale: float):
    import triton

    from specter.counting import launched
    from specter.quant.kernels import _kernel

    (T, H), E = x.shape, weight.shape[0]
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("route_topk: the hidden states' rows and the router's weight must be "
                         "contiguous")
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    index = torch.empty(T, k, dtype=torch.int64, device=x.device)
    block_e = triton.next_power_of_2(E)
    launched("triton")
    _kernel("route_topk")[(T,)](x, weight, logits, weights, index, E, H, x.stride(0),
                                float(scale), TOPK=k, BLOCK_E=block_e,
                                BLOCK_H=max(16, min(128, 8192 // block_e)))
    return logits, weights, index


@torch.library.custom_op("specter::route_topk", mutates_args=())
def route_topk(x: torch.Tensor, weight: torch.Tensor, k: int, scale: float,
               use_triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] (the hidden states), weight [E, H] (the router's) -> (logits [T, E] fp32;
    weights [T, k] fp32: the k largest softmax probabilities times `scale`, largest first;
    index [T, k] int64: their experts). `use_triton`: one Triton launch (CUDA, or the CPU
    under TRITON_INTERPRET=1); else transformers' router in torch."""
    return fused_or_torch("route_topk", use_triton, _route_topk_launch, _route_topk_torch, x, weight,
                  k, scale)


@route_topk.register_fake
def _(x, weight, k, scale, use_triton):
    T, E = x.shape[0], weight.shape[0]
    return (x.new_empty((T, E), dtype=torch.float32), x.new_empty((T, k), dtype=torch.float32),
            x.new_empty((T, k), dtype=torch.int64))


# -- the attention of one step as one op ---------------------------------------------------------
def _mla_decode_torch(q, kv, norm_w, eps, rot, latent, pe, index, w_kvb, heads, dn, dr, dv,
                      scaling):
    """transformers' DeepSeek-V2 attention after its projections, over a static cache written
    at `index` (the rotation in real arithmetic, `rotate_real`), causal: the mask
    transformers makes for it."""
    B, T, _ = q.shape
    R, L = latent.shape[-1], latent.shape[2]
    x, k_pe = kv.split([R, dr], dim=-1)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    k_nope = norm_w * xf.to(x.dtype)
    cos, sin = rot[..., 0].unsqueeze(1), rot[..., 1].unsqueeze(1)  # [b, 1, T, dr/2]
    at = torch.arange(T, device=q.device) + index
    latent.index_copy_(2, at, k_nope.view(B, 1, T, R).to(latent.dtype))
    pe.index_copy_(2, at, rotate_real(k_pe.view(B, 1, T, dr), cos, sin).to(pe.dtype))
    qh = q.view(B, T, heads, dn + dr).transpose(1, 2)
    q_nope, q_pe = qh.split([dn, dr], dim=-1)
    query = torch.cat((q_nope, rotate_real(q_pe, cos, sin)), dim=-1)
    kvb = F.linear(latent, w_kvb).view(B, L, heads, dn + dv).transpose(1, 2)
    k_nope_all, value = kvb.split([dn, dv], dim=-1)
    key = torch.cat((k_nope_all, pe.expand(B, heads, L, dr)), dim=-1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    future = torch.arange(L, device=q.device) > at[:, None]  # [T, L]
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).reshape(B, T, heads * dv)


def _mla_decode_launch(q, kv, norm_w, eps, rot, latent, pe, index, w_kvb, heads, dn, dr, dv,
                       scaling):
    import triton

    from specter.counting import launched
    from specter.quant.kernels import _kernel

    B, T, _ = q.shape
    R, L = latent.shape[-1], latent.shape[2]
    if T != 1:
        raise ValueError("mla_decode: the Triton kernel takes one new token a row")
    for name, t in (("rot", rot), ("latent", latent), ("pe", pe), ("kv_b_proj", w_kvb)):
        if not t.is_contiguous():
            raise ValueError(f"mla_decode: {name} must be contiguous")
    for name, t in (("q", q), ("kv", kv)):  # rows of one GEMM's output (merged_projections)
        if t.stride(2) != 1:
            raise ValueError(f"mla_decode: {name}'s rows must be contiguous")
    out = q.new_empty(B, T, heads * dv)
    launched("triton")
    _kernel("mla_decode_step", DRAFT_KERNELS)[(B * heads,)](
        q, kv, norm_w, rot, latent, pe, index, w_kvb, out, float(eps), float(scaling), L, heads,
        q.stride(0), kv.stride(0), rot.stride(0) if rot.shape[0] > 1 else 0, R=R, DN=dn, DR=dr,
        DV=dv, BLOCK_R=triton.next_power_of_2(R),
        BLOCK_P=triton.next_power_of_2(max(dr // 2, 1)), BLOCK_D=16, BLOCK_L=16)
    return out


@torch.library.custom_op("specter::mla_decode", mutates_args=("latent", "pe"))
def mla_decode(q: torch.Tensor, kv: torch.Tensor, norm_w: torch.Tensor, eps: float,
               rot: torch.Tensor, latent: torch.Tensor, pe: torch.Tensor, index: torch.Tensor,
               w_kvb: torch.Tensor, heads: int, dn: int, dr: int, dv: int, scaling: float,
               use_triton: bool) -> torch.Tensor:
    """DeepSeek-V2's attention of T new tokens after q_proj and kv_a_proj_with_mqa, over the
    static draft cache: q [B, T, heads (dn + dr)], kv [B, T, R + dr]; the latent normed
    (`norm_w`, `eps`) and the rotary key rotated by rot [B or 1, T, dr/2, 2] (cos, sin) are
    written into latent [B, 1, L, R] and pe [B, 1, L, dr] at index [1] + 0..T-1; returns the
    heads' outputs [B, T, heads dv] (before o_proj), token i attending to positions up to
    index + i: the causal mask transformers makes over the draft's static cache, which holds
    one row filled up to its write index (so the mask itself need not be made or read: one
    kernel a layer fewer). `use_triton`: one Triton launch (models/triton_draft.py; CUDA, or
    the CPU under TRITON_INTERPRET=1; T = 1, a draft step's), attention absorbed into the
    latent; else transformers' own formulation in torch."""
    return fused_or_torch("mla_decode", use_triton, _mla_decode_launch, _mla_decode_torch, q, kv,
                  norm_w, eps, rot, latent, pe, index, w_kvb, heads, dn, dr, dv, scaling)


@mla_decode.register_fake
def _(q, kv, norm_w, eps, rot, latent, pe, index, w_kvb, heads, dn, dr, dv, scaling,
      use_triton):
    return q.new_empty(q.shape[0], q.shape[1], heads * dv)


# -- a residual add and the norm after it as one op ------------------------------------------------
DRAFT_KERNELS = "specter.models.triton_draft"


def _add_rms_norm_torch(x, y, z, weight, eps):
    """transformers' order: y cast to x's dtype (+ z), added to x; then its RMSNorm."""
    y = y.to(x.dtype)
    total = x + (y if z is None else y + z)
    v = total.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return total, weight * v.to(total.dtype)


def _add_rms_norm_launch(x, y, z, weight, eps):
    import triton

    from specter.counting import launched
    from specter.quant.kernels import _kernel

    H = x.shape[-1]
    rows = x.numel() // H
    parts = [t.reshape(rows, H) for t in ((x, y) if z is None else (x, y, z))]
    if any(t.stride(1) != 1 for t in parts) or not weight.is_contiguous():
        raise ValueError("add_rms_norm: rows must be contiguous")
    total = torch.empty_like(x)
    out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    third = parts[2] if z is not None else parts[0]
    launched("triton")
    _kernel("add_rms_norm", DRAFT_KERNELS)[(rows,)](
        parts[0], parts[1], third, weight, total, out, H, float(eps), parts[0].stride(0),
        parts[1].stride(0), third.stride(0), HAS_Z=z is not None,
        BLOCK_H=triton.next_power_of_2(H))
    return total, out


@torch.library.custom_op("specter::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y (+ z) [..., H] in x's dtype (the next residual; y may be fp32: the routed
    experts' sum) and its RMSNorm times `weight`, as transformers' DeepSeek-V2 decoder layer
    computes them. `use_triton`: one Triton launch (models/triton_draft.py, as vLLM's fused
    add and norm: the compiler's CPU code makes a norm two kernels, a reduction and its use);
    else transformers' order in torch."""
    return fused_or_torch("add_rms_norm", use_triton, _add_rms_norm_launch, _add_rms_norm_torch, x, y,
                  z, weight, eps)


@add_rms_norm.register_fake
def _(x, y, z, weight, eps, use_triton):
    return torch.empty_like(x), x.new_empty(x.shape,
                                            dtype=torch.promote_types(weight.dtype, x.dtype))


def _silu_mul_gemv_torch(gu, weight):
    gate, up = gu.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


def _silu_mul_gemv_launch(gu, weight):
    from specter.counting import launched
    from specter.quant.kernels import _kernel

    (N, I), rows = weight.shape, gu.numel() // gu.shape[-1]
    flat = gu.reshape(rows, gu.shape[-1])
    if flat.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("silu_mul_gemv: rows must be contiguous")
    out = gu.new_empty(*gu.shape[:-1], N)
    block_n = 16
    launched("triton")
    _kernel("silu_mul_gemv", DRAFT_KERNELS)[(rows, (N + block_n - 1) // block_n)](
        flat, weight, out, N, I, flat.stride(0), BLOCK_N=block_n, BLOCK_K=256)
    return out


@torch.library.custom_op("specter::silu_mul_gemv", mutates_args=())
def silu_mul_gemv(gu: torch.Tensor, weight: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """An MLP's down projection of silu(gate) * up: gu [..., 2I] (the merged gate_up GEMM's
    output), weight [N, I] -> [..., N]. `use_triton`: one Triton launch (the activation read
    on the fly); else transformers' MLP in torch."""
    return fused_or_torch("silu_mul_gemv", use_triton, _silu_mul_gemv_launch, _silu_mul_gemv_torch,
                  gu, weight)


@silu_mul_gemv.register_fake
def _(gu, weight, use_triton):
    return gu.new_empty(*gu.shape[:-1], weight.shape[0])


class Carried(NamedTuple):
    """A draft-step layer's output handed to the next layer: the sum (its residual) and that
    sum already normed by the next layer's input norm (or the model's final norm)."""
    out: torch.Tensor
    normed: torch.Tensor


NEXT_NORM = "_specter_next_norm"  # a decoder layer's successor's input norm (`chain_norms`)


def chain_norms(model) -> int:
    """Tell each DeepSeek-V2 decoder layer the norm that reads its output (the next layer's
    input norm, the last layer the model's final norm), so that a draft step ends each layer
    with the add and that norm in one op (`Carried`). A plain attribute, not a submodule.
    Returns the layers chained."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    inner = getattr(model, "model", None)
    if not isinstance(inner, ds.DeepseekV2Model):
        return 0
    layers = list(inner.layers[: inner.config.num_hidden_layers])
    norms = [layer.input_layernorm for layer in layers[1:]] + [inner.norm]
    for layer, norm in zip(layers, norms):
        object.__setattr__(layer, NEXT_NORM, norm)
    return len(layers)


def prepare(model) -> None:
    """What the compiled draft step needs of a model once: merged projections (one GEMM where
    two read one input) and chained norms."""
    if merge_projections(model):
        device = next(model.parameters()).device
        if device.type == "cuda":  # the pairs' old blocks (one layer's: the next reused them)
            torch.cuda.empty_cache()  # go back to the device, not held in the reserve
    chain_norms(model)


def _moe_parts(moe, x):
    """transformers' DeepseekV2Moe.forward without its last add: (routed experts' output,
    shared experts' output), in its order (router, experts, shared experts)."""
    _, weights, index = moe.gate(x)
    routed = moe.experts(x.view(-1, x.shape[-1]), index, weights).view(*x.shape[:-1], -1)
    return routed, moe.shared_experts(x)


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (torch.nn.SiLU, SiLUActivation))


def _use_triton(t: torch.Tensor) -> bool:
    from specter.quant.kernels import triton_available

    return t.device.type == "cuda" and triton_available()


def install() -> None:
    """Wrap transformers' DeepSeek-V2 code once with this module's formulations: each
    unchanged unless `DRAFT_STEP.on` (and, for the layer's and the MLP's, the model
    `prepare`d)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    _patch(ds, "apply_rotary_emb", _rope)
    _patch(ds.DeepseekV2TopkRouter, "forward", _router)
    _patch(ds.DeepseekV2Attention, "forward", _attention)
    _patch(ds.DeepseekV2MLP, "forward", _mlp)
    _patch(ds.DeepseekV2DecoderLayer, "forward", _decoder_layer)
    _patch(ds.DeepseekV2RMSNorm, "forward", _norm)


def _patch(owner, name: str, make) -> None:
    """`owner.name` replaced, once, by `make(the original)`, which keeps it as `__wrapped__`
    (once even where another patch, verification's pieces, has wrapped it since)."""
    original = getattr(owner, name)
    f = original
    while f is not None:
        if getattr(f, "_specter_draft_step", False):
            return
        f = getattr(f, "__wrapped__", None)
    new = make(original)
    new._specter_draft_step = True
    new.__wrapped__ = original
    setattr(owner, name, new)


def _rope(rope):
    def apply_rotary_emb(xq, xk, freqs_cis):
        if not DRAFT_STEP.on:
            return rope(xq, xk, freqs_cis)
        rot = torch.view_as_real(freqs_cis.unsqueeze(1).to(xq.device))  # [b, 1, s, d/2, 2]
        cos, sin = rot[..., 0], rot[..., 1]
        return rotate_real(xq, cos, sin), rotate_real(xk, cos, sin)
    return apply_rotary_emb


def _router(route):
    def forward(self, hidden_states):
        if not DRAFT_STEP.on or self.topk_method != "greedy":
            return route(self, hidden_states)
        x = hidden_states.view(-1, self.hidden_dim)
        return torch.ops.specter.route_topk(x, self.weight, self.top_k,
                                            float(self.routed_scaling_factor), _use_triton(x))
    return forward


def _attention(attend):
    def forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None,
                **kwargs):
        layer = _one_index_layer(cache, self.layer_idx)
        if (not DRAFT_STEP.on or layer is None or hidden_states.shape[1] != 1
                or kwargs.get("_specter_pieces") is not None):
            return attend(self, hidden_states=hidden_states, attention_mask=attention_mask,
                          cache=cache, position_embeddings=position_embeddings, **kwargs)
        q, kv = _query_and_latent(self, hidden_states)
        rot = torch.view_as_real(position_embeddings.to(q.device))
        norm = self.kv_a_layernorm
        out = torch.ops.specter.mla_decode(
            q, kv, norm.weight, float(norm.variance_epsilon), rot, layer.keys, layer.values,
            layer.cumulative_length, self.kv_b_proj.weight, self.num_heads,
            self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, float(self.scaling),
            _use_triton(q))
        return self.o_proj(out), None
    return forward


def _mlp(mlp):
    def forward(self, x):
        gate_up = getattr(self, MERGED, None)
        if not DRAFT_STEP.on or gate_up is None:
            return mlp(self, x)
        gu = F.linear(x, gate_up)
        if self.down_proj.bias is None and _is_silu(self.act_fn):
            return torch.ops.specter.silu_mul_gemv(gu, self.down_proj.weight, _use_triton(gu))
        gate, up = gu.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)
    return forward


def _decoder_layer(layer_forward):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs):
        nxt = getattr(self, NEXT_NORM, None)
        if not DRAFT_STEP.on or nxt is None:
            if isinstance(hidden_states, Carried):
                hidden_states = hidden_states.out
            return layer_forward(self, hidden_states, attention_mask=attention_mask,
                                 position_ids=position_ids, cache=cache, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        if isinstance(hidden_states, Carried):
            residual, x = hidden_states
        else:
            residual, x = hidden_states, self.input_layernorm(hidden_states)
        attn, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask,
                                 position_ids=position_ids, cache=cache, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        fused = _use_triton(residual)
        post = self.post_attention_layernorm
        hidden, x = torch.ops.specter.add_rms_norm(residual, attn, None, post.weight,
                                                   float(post.variance_epsilon), fused)
        if isinstance(self.mlp, ds.DeepseekV2Moe):
            routed, shared = _moe_parts(self.mlp, x)
        else:
            routed, shared = self.mlp(x), None
        return Carried(*torch.ops.specter.add_rms_norm(
            hidden, routed, shared, nxt.weight, float(nxt.variance_epsilon), fused))
    return forward


def _norm(norm_forward):
    def forward(self, hidden_states):
        if isinstance(hidden_states, Carried):  # normed by the layer that made it
            return hidden_states.normed
        return norm_forward(self, hidden_states)
    return forward


def _query_and_latent(attn, hidden_states):
    """The attention's query (q_proj, or q_a -> norm -> q_b) and its latent's projection
    (kv_a_proj_with_mqa): one GEMM for both where they are merged (`merge_projections`)."""
    merged = getattr(attn, MERGED, None)
    if merged is not None:
        first, kv = F.linear(hidden_states, merged).split(
            [merged.shape[0] - attn.kv_a_proj_with_mqa.out_features,
             attn.kv_a_proj_with_mqa.out_features], dim=-1)
    else:
        first = attn.q_proj(hidden_states) if attn.q_lora_rank is None else attn.q_a_proj(
            hidden_states)
        kv = attn.kv_a_proj_with_mqa(hidden_states)
    if attn.q_lora_rank is None:
        return first, kv
    return attn.q_b_proj(attn.q_a_layernorm(first)), kv


# -- GEMMs that read one input, merged ------------------------------------------------------------
MERGED = "_specter_merged"  # the module's merged weight (a plain attribute: not a parameter)


def merge_projections(model) -> int:
    """Each DeepSeek-V2 attention's first projections (q_proj or q_a_proj, and
    kv_a_proj_with_mqa) and each MLP's gate_proj and up_proj (the dense layers' and the
    shared experts') made views of one weight, which the draft step multiplies in one GEMM
    (as vLLM's merged linear layers): one kernel fewer each. The parts keep their values and
    their places (the target runs its own GEMMs on them, bit for bit as before: each view
    starts where a lone weight would, on a 64-byte boundary; a module whose parts are not
    so placed, or have biases, stays as it is), and no byte is added. Returns how many
    modules were merged."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    merged = 0
    for m in model.modules():
        if isinstance(m, ds.DeepseekV2Attention):
            first = m.q_proj if m.q_lora_rank is None else m.q_a_proj
            merged += _merge(m, (first, m.kv_a_proj_with_mqa))
        elif isinstance(m, ds.DeepseekV2MLP):
            merged += _merge(m, (m.gate_proj, m.up_proj))
    return merged


def _merge(owner, linears) -> int:
    if getattr(owner, MERGED, None) is not None:
        return 0
    ws = [lin.weight for lin in linears]
    w0 = ws[0]
    if any(lin.bias is not None for lin in linears) or any(
            w.device != w0.device or w.dtype != w0.dtype or w.shape[1] != w0.shape[1]
            or w.is_meta or not w.is_contiguous() for w in ws):
        return 0
    row_bytes = w0.shape[1] * w0.element_size()
    if any(sum(w.shape[0] for w in ws[:i]) * row_bytes % 64 for i in range(1, len(ws))):
        return 0
    with torch.no_grad():
        whole = torch.cat(ws)
    start = 0
    for lin, w in zip(linears, ws):
        n = w.shape[0]
        lin.weight = torch.nn.Parameter(whole[start:start + n], requires_grad=w.requires_grad)
        start += n
    object.__setattr__(owner, MERGED, whole)
    return 1


def _one_index_layer(cache, layer_idx: int):
    """The draft buffers' layer `layer_idx` where it writes at the shared index
    (compiled_draft.one_write_index: keys the latent, values the rotary key), else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    return layer if getattr(type(layer), "one_write_index", False) else None
