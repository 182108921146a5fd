"""DeepSeek-V2's rotary embedding in real arithmetic for the compiled draft step.

transformers' DeepSeek-V2 rotates the query's and key's rotary part in complex arithmetic
(`apply_rotary_emb`: view_as_complex, a complex multiply, view_as_real). The compiler cannot
generate code for complex tensors: each complex multiply stays a library call and each view a
copy. The same rotation in real arithmetic, pair (x0, x1) by (cos, sin) -> (x0 cos - x1 sin,
x0 sin + x1 cos), is pointwise and fuses with its neighbours: one kernel a layer fewer at
DeepSeek-V2-Lite's depth (experiments.kernel_count; its whole attention computed absorbed, as
DeepSeek's own decoder does, counted the same on the CPU and is not kept). Same math, other
rounding in the last bit: a draft only proposes.

Only the compiled draft step uses it (`compiled_draft.StaticKV` turns `REAL_ROPE` on around its
steps; the compiler guards on the switch): the target, its verification and every eager path
keep transformers' own code, so the output stays the target's bit for bit.
"""

from __future__ import annotations

import contextlib

import torch


class _Switch:
    on = False


REAL_ROPE = _Switch()


@contextlib.contextmanager
def real_rope():
    """Inside the block, DeepSeek-V2's rotary embedding runs in real arithmetic."""
    previous, REAL_ROPE.on = REAL_ROPE.on, True
    try:
        yield
    finally:
        REAL_ROPE.on = previous


def rotate_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] (interleaved pairs, DeepSeek's complex layout) rotated by cos, sin
    [..., d/2] (broadcast), in float32, returned in x's dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def install() -> None:
    """Wrap transformers' DeepSeek-V2 `apply_rotary_emb` once: unchanged unless `REAL_ROPE.on`."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds

    original = ds.apply_rotary_emb
    if getattr(original, "_specter_real_rope", False):
        return

    def apply_rotary_emb(xq, xk, freqs_cis):
        if not REAL_ROPE.on:
            return original(xq, xk, freqs_cis)
        rot = torch.view_as_real(freqs_cis.unsqueeze(1).to(xq.device))  # [b, 1, s, d/2, 2]
        cos, sin = rot[..., 0], rot[..., 1]
        return rotate_real(xq, cos, sin), rotate_real(xk, cos, sin)

    apply_rotary_emb._specter_real_rope = True
    apply_rotary_emb.__wrapped__ = original
    ds.apply_rotary_emb = apply_rotary_emb
