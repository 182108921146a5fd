"""DeepSeek-V2's multi-head latent attention for one draft step, as two plain functions for
`triton.jit` (quant/kernels.py `_kernel` jits them once per mode: compiled on CUDA, or
interpreted on the CPU with TRITON_INTERPRET=1). draft_step.py `mla_decode` launches them.

`mla_write` (a program per token): the new token's latent normed (RMSNorm, fp32) and its
rotary key rotated (interleaved pairs by cos, sin), both written into the static draft cache
at the shared write index (+ the token's offset).

`mla_attend` (a program per token and head): attention over the cache's positions up to the
token's own (index + its offset: causal, as the static draft cache is filled) computed absorbed, as DeepSeek's own decoder does: the query's no-rope part is
multiplied into kv_b_proj's key rows (q_lat = W_UK[h]^T q_nope, over the latent), scores are
q_lat . latent[t] + rot(q_pe) . pe[t] (times `scaling`), an online softmax
sums the latents, and kv_b_proj's value rows map that sum to the head's output. All in fp32,
stored in the output's dtype. What transformers computes as kv_b_proj over every cached
position, two concatenations and two batched products is one pass over the cache here.
"""

import triton.language as tl


def mla_write(kv_ptr, norm_ptr, rot_ptr, latent_ptr, pe_ptr, index_ptr, eps, T, L,
              stride_kv, stride_rot_b, R: tl.constexpr, DR: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """kv [B*T, R + DR] (kv_a_proj's output; rows `stride_kv` apart) -> latent [B, 1, L, R]
    and pe [B, 1, L, DR] at position index[0] + the token's offset; rot [B or 1, T, DR/2, 2]
    (cos, sin)."""
    bt = tl.program_id(0).to(tl.int64)
    b, i = bt // T, bt % T
    pos = tl.load(index_ptr).to(tl.int64) + i
    offs_r = tl.arange(0, BLOCK_R)
    rm = offs_r < R
    x = tl.load(kv_ptr + bt * stride_kv + offs_r, mask=rm, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / R
    w = tl.load(norm_ptr + offs_r, mask=rm, other=0.0).to(tl.float32)
    y = w * (x * tl.rsqrt(var + eps))
    tl.store(latent_ptr + (b * L + pos) * R + offs_r, y.to(latent_ptr.dtype.element_ty),
             mask=rm)
    offs_p = tl.arange(0, BLOCK_P)
    pm = offs_p < DR // 2
    k0 = tl.load(kv_ptr + bt * stride_kv + R + 2 * offs_p, mask=pm, other=0.0).to(tl.float32)
    k1 = tl.load(kv_ptr + bt * stride_kv + R + 2 * offs_p + 1, mask=pm, other=0.0).to(tl.float32)
    rot = rot_ptr + b * stride_rot_b + i * DR + 2 * offs_p
    c = tl.load(rot, mask=pm, other=0.0).to(tl.float32)
    s = tl.load(rot + 1, mask=pm, other=0.0).to(tl.float32)
    out = pe_ptr + (b * L + pos) * DR + 2 * offs_p
    tl.store(out, (k0 * c - k1 * s).to(pe_ptr.dtype.element_ty), mask=pm)
    tl.store(out + 1, (k0 * s + k1 * c).to(pe_ptr.dtype.element_ty), mask=pm)


def mla_attend(q_ptr, rot_ptr, latent_ptr, pe_ptr, index_ptr, w_ptr, out_ptr, scaling, T, L,
               H, stride_q, stride_rot_b, R: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr,
               DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """q [B*T, H*(DN+DR)] (q_proj's output, rope part not yet rotated; rows `stride_q`
    apart), w = kv_b_proj's weight
    [H*(DN+DV), R] -> out [B*T, H*DV]; token i attends to the cache's positions up to its
    own, index[0] + i (causal over a cache filled up to the write index)."""
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    bt = pid // H
    b, i = bt // T, bt % T
    offs_r = tl.arange(0, BLOCK_R)
    rm = offs_r < R
    q_row = q_ptr + bt * stride_q + h * (DN + DR)
    w_head = w_ptr + h * (DN + DV) * R
    # the query absorbed into the key rows of kv_b_proj: q_lat [R]
    q_lat = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, DN, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dm = offs_d < DN
        qn = tl.load(q_row + offs_d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(w_head + offs_d[:, None] * R + offs_r[None, :],
                    mask=dm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        q_lat += tl.sum(w * qn[:, None], axis=0)
    # the rotary part, rotated
    offs_p = tl.arange(0, BLOCK_P)
    pm = offs_p < DR // 2
    x0 = tl.load(q_row + DN + 2 * offs_p, mask=pm, other=0.0).to(tl.float32)
    x1 = tl.load(q_row + DN + 2 * offs_p + 1, mask=pm, other=0.0).to(tl.float32)
    rot = rot_ptr + b * stride_rot_b + i * DR + 2 * offs_p
    c = tl.load(rot, mask=pm, other=0.0).to(tl.float32)
    s = tl.load(rot + 1, mask=pm, other=0.0).to(tl.float32)
    qp0 = x0 * c - x1 * s
    qp1 = x0 * s + x1 * c
    # one pass over the valid positions: an online softmax over the latents
    n_valid = tl.load(index_ptr).to(tl.int64) + i + 1
    m = tl.full([1], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for t0 in range(0, n_valid, BLOCK_L):
        offs_t = t0 + tl.arange(0, BLOCK_L)
        tm = offs_t < n_valid
        lat = tl.load(latent_ptr + (b * L + offs_t[:, None]) * R + offs_r[None, :],
                      mask=tm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        pe = pe_ptr + (b * L + offs_t[:, None]) * DR + 2 * offs_p[None, :]
        p0 = tl.load(pe, mask=tm[:, None] & pm[None, :], other=0.0).to(tl.float32)
        p1 = tl.load(pe + 1, mask=tm[:, None] & pm[None, :], other=0.0).to(tl.float32)
        score = (tl.sum(lat * q_lat[None, :], axis=1)
                 + tl.sum(p0 * qp0[None, :] + p1 * qp1[None, :], axis=1)) * scaling
        score = tl.where(tm, score, -float("inf"))
        m_new = tl.maximum(m, tl.max(score, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new)
        denom = denom * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * lat, axis=0)
        m = m_new
    acc = acc / denom
    # the value rows of kv_b_proj map the summed latent to the head's output
    for e0 in range(0, DV, BLOCK_D):
        offs_e = e0 + tl.arange(0, BLOCK_D)
        em = offs_e < DV
        w = tl.load(w_head + (DN + offs_e[:, None]) * R + offs_r[None, :],
                    mask=em[:, None] & rm[None, :], other=0.0).to(tl.float32)
        o = tl.sum(w * acc[None, :], axis=1)
        tl.store(out_ptr + bt * H * DV + h * DV + offs_e, o.to(out_ptr.dtype.element_ty),
                 mask=em)
