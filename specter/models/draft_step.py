"""The compiled draft step's own formulations of DeepSeek-V2's layers: fewer kernels, same math.

A captured draft step runs its kernels back to back, each costing at least a few
microseconds on the device (docs/clocks.md, "The kernel floor"), so the step is worth writing
for the compiler where transformers' eager code costs kernels that no fusion removes:

- the rotary embedding: transformers rotates the query's and key's rotary part in complex
  arithmetic (`apply_rotary_emb`: view_as_complex, a complex multiply, view_as_real). The
  compiler cannot generate code for complex tensors: each complex multiply stays a library
  call and each view a copy. Here the same rotation in real arithmetic, pair (x0, x1) by
  (cos, sin) -> (x0 cos - x1 sin, x0 sin + x1 cos): pointwise, fused with its neighbours.
- the router: transformers' greedy top-k router is its GEMM, a softmax and a top-k, which the
  compiler makes five kernels (the softmax's max, sum and division, the top-k, a copy). Here
  the GEMM and one custom op (`specter::softmax_topk`): on CUDA one Triton kernel a token
  (quant/triton_moe.py `softmax_topk`), as vLLM's fused top-k softmax; elsewhere the same in
  torch. The experts come largest first (transformers' order is unspecified: sorted=False).

Counted by experiments.kernel_count (DeepSeek-V2-Lite's depth; docs/clocks.md). The whole
attention computed absorbed (the query multiplied into kv_b_proj's key half, scores against
the cached latent), as DeepSeek's own decoder does, counted the same on the CPU and is not kept.

Only the compiled draft step uses these (`compiled_draft.StaticKV` turns `DRAFT_STEP` on around
its steps and its capture; the compiler guards on the switch): the target, its verification
and every eager path keep transformers' own code, so the output stays the target's bit for
bit. The draft rounds differently in the last bits; a draft only proposes.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

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


# -- the router's softmax and top-k as one op ---------------------------------------------------
def _softmax_topk_torch(logits: torch.Tensor, k: int, scale: float):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, index = torch.topk(probs, k, dim=-1, sorted=True)
    return weights * scale, index


def _softmax_topk_launch(logits: torch.Tensor, k: int, scale: float):
    import triton

    from specter.counting import launched
    from specter.quant.kernels import _kernel

    T, E = logits.shape
    logits = logits.float().contiguous()
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    index = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    launched("triton")
    _kernel("softmax_topk")[(T,)](logits, weights, index, E, logits.stride(0), float(scale),
                                  TOPK=k, BLOCK_E=triton.next_power_of_2(E))
    return weights, index


@torch.library.custom_op("specter::softmax_topk", mutates_args=())
def softmax_topk(logits: torch.Tensor, k: int, scale: float,
                 use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32: the k largest softmax probabilities times
    `scale`, largest first; index [T, k] int64: their experts). `use_triton`: one Triton
    launch (CUDA, or the CPU under TRITON_INTERPRET=1); else the same in torch."""
    run = _softmax_topk_launch if use_triton else _softmax_topk_torch
    return run(logits, k, scale)


@softmax_topk.register_fake
def _(logits, k, scale, use_triton):
    T = logits.shape[0]
    return (logits.new_empty((T, k), dtype=torch.float32),
            logits.new_empty((T, k), dtype=torch.int64))


def _use_triton(t: torch.Tensor) -> bool:
    from specter.quant.kernels import triton_available

    return t.device.type == "cuda" and triton_available()


def install() -> None:
    """Wrap transformers' DeepSeek-V2 `apply_rotary_emb` and greedy router once: each
    unchanged unless `DRAFT_STEP.on`."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    rope = ds.apply_rotary_emb
    if not getattr(rope, "_specter_draft_step", False):
        def apply_rotary_emb(xq, xk, freqs_cis):
            if not DRAFT_STEP.on:
                return rope(xq, xk, freqs_cis)
            rot = torch.view_as_real(freqs_cis.unsqueeze(1).to(xq.device))  # [b, 1, s, d/2, 2]
            cos, sin = rot[..., 0], rot[..., 1]
            return rotate_real(xq, cos, sin), rotate_real(xk, cos, sin)

        apply_rotary_emb._specter_draft_step = True
        apply_rotary_emb.__wrapped__ = rope
        ds.apply_rotary_emb = apply_rotary_emb

    route = ds.DeepseekV2TopkRouter.forward
    if not getattr(route, "_specter_draft_step", False):
        def forward(self, hidden_states):
            if not DRAFT_STEP.on or self.topk_method != "greedy":
                return route(self, hidden_states)
            logits = F.linear(hidden_states.view(-1, self.hidden_dim).float(),
                              self.weight.float())
            weights, index = torch.ops.specter.softmax_topk(
                logits, self.top_k, float(self.routed_scaling_factor), _use_triton(logits))
            return logits, weights, index

        forward._specter_draft_step = True
        forward.__wrapped__ = route
        ds.DeepseekV2TopkRouter.forward = forward
