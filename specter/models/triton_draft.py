"""The compiled draft step's own kernels for DeepSeek-V2's layers (models/draft_step.py), as
plain functions for `triton.jit` (quant/kernels.py `_kernel` jits them once per mode: compiled
on CUDA, or interpreted on the CPU with TRITON_INTERPRET=1).

`mla_decode_step` (a program per row and head, one new token a row): multi-head latent
attention. The new token's latent normed (RMSNorm, fp32) and its rotary key rotated
(interleaved pairs by cos, sin), kept in registers (the head-0 program also writes both into
the static draft cache at the write index); then attention over the cache's positions before
the index and the new token, computed absorbed, as DeepSeek's own decoder does: the query's
no-rope part multiplied into kv_b_proj's key rows (q_lat = W_UK[h]^T q_nope, over the
latent), scores q_lat . latent[t] + rot(q_pe) . pe[t] (times `scaling`), an online softmax
summing the latents, and kv_b_proj's value rows mapping that sum to the head's output. All in
fp32, stored in the output's dtype. What transformers computes as the norm, two rotations,
two cache writes, kv_b_proj over every cached position, two concatenations and two batched
products is one launch here.

`add_rms_norm` (a program per row): a residual add (two or three terms) and the RMSNorm
after it, as vLLM's fused_add_rms_norm: the sum and its norm in one launch.

`silu_mul_gemv` (a program per row and block of outputs): an MLP's down projection reading
silu(gate) * up on the fly from the merged gate_up GEMM's output: the activation and the
GEMV in one launch (a few tokens a step: the weight's bytes are the cost).
"""

import triton.language as tl


def mla_decode_step(q_ptr, kv_ptr, norm_ptr, rot_ptr, latent_ptr, pe_ptr, index_ptr, w_ptr,
                    out_ptr, eps, scaling, L, H, stride_q, stride_kv, stride_rot_b,
                    R: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_L: tl.constexpr):
    """q [B, H*(DN+DR)] (q_proj's output, rope part not yet rotated), kv [B, R + DR]
    (kv_a_proj's), rows `stride_q`, `stride_kv` apart; rot [B or 1, DR/2, 2] (cos, sin);
    latent [B, 1, L, R], pe [B, 1, L, DR] (the cache; the new token goes at index[0]);
    w = kv_b_proj's weight [H*(DN+DV), R] -> out [B, H*DV]."""
    pid = tl.program_id(0).to(tl.int64)
    h = pid % H
    b = pid // H
    pos = tl.load(index_ptr).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rm = offs_r < R
    offs_p = tl.arange(0, BLOCK_P)
    pm = offs_p < DR // 2
    rot = rot_ptr + b * stride_rot_b + 2 * offs_p
    c = tl.load(rot, mask=pm, other=0.0).to(tl.float32)
    s = tl.load(rot + 1, mask=pm, other=0.0).to(tl.float32)
    # the new token's latent, normed, and its rotary key, rotated (written by head 0)
    x = tl.load(kv_ptr + b * stride_kv + offs_r, mask=rm, other=0.0).to(tl.float32)
    nw = tl.load(norm_ptr + offs_r, mask=rm, other=0.0).to(tl.float32)
    lat_new = nw * (x * tl.rsqrt(tl.sum(x * x, axis=0) / R + eps))
    k0 = tl.load(kv_ptr + b * stride_kv + R + 2 * offs_p, mask=pm, other=0.0).to(tl.float32)
    k1 = tl.load(kv_ptr + b * stride_kv + R + 2 * offs_p + 1, mask=pm, other=0.0).to(tl.float32)
    pe0, pe1 = k0 * c - k1 * s, k0 * s + k1 * c
    tl.store(latent_ptr + (b * L + pos) * R + offs_r, lat_new.to(latent_ptr.dtype.element_ty),
             mask=rm & (offs_r * 0 + h == 0))
    at = pe_ptr + (b * L + pos) * DR + 2 * offs_p
    tl.store(at, pe0.to(pe_ptr.dtype.element_ty), mask=pm & (offs_p * 0 + h == 0))
    tl.store(at + 1, pe1.to(pe_ptr.dtype.element_ty), mask=pm & (offs_p * 0 + h == 0))
    # the cache rounds what it stores: the new token's score reads it as the cache holds it
    lat_new = lat_new.to(latent_ptr.dtype.element_ty).to(tl.float32)
    pe0 = pe0.to(pe_ptr.dtype.element_ty).to(tl.float32)
    pe1 = pe1.to(pe_ptr.dtype.element_ty).to(tl.float32)
    # the query absorbed into the key rows of kv_b_proj: q_lat [R]
    q_row = q_ptr + b * stride_q + h * (DN + DR)
    w_head = w_ptr + h * (DN + DV) * R
    q_lat = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, DN, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        dm = offs_d < DN
        qn = tl.load(q_row + offs_d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(w_head + offs_d[:, None] * R + offs_r[None, :],
                    mask=dm[:, None] & rm[None, :], other=0.0).to(tl.float32)
        q_lat += tl.sum(w * qn[:, None], axis=0)
    x0 = tl.load(q_row + DN + 2 * offs_p, mask=pm, other=0.0).to(tl.float32)
    x1 = tl.load(q_row + DN + 2 * offs_p + 1, mask=pm, other=0.0).to(tl.float32)
    qp0, qp1 = x0 * c - x1 * s, x0 * s + x1 * c
    # the new token first, then one pass over the cached positions: an online softmax
    m = (tl.sum(lat_new * q_lat, axis=0) + tl.sum(pe0 * qp0 + pe1 * qp1, axis=0)) * scaling
    denom = tl.full([1], 1.0, dtype=tl.float32)
    acc = lat_new
    for t0 in range(0, pos, BLOCK_L):
        offs_t = t0 + tl.arange(0, BLOCK_L)
        tm = offs_t < pos
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
        tl.store(out_ptr + b * H * DV + h * DV + offs_e, o.to(out_ptr.dtype.element_ty),
                 mask=em)


def add_rms_norm(x_ptr, y_ptr, z_ptr, w_ptr, sum_ptr, out_ptr, H, eps, stride_x, stride_y,
                 stride_z, HAS_Z: tl.constexpr, BLOCK_H: tl.constexpr):
    """sum[t] = x[t] + y[t] (+ z[t]) (fp32, stored in sum's dtype) and out[t] = w * norm(sum[t])
    (the stored sum read back, normed in fp32, rounded to sum's dtype, times w: transformers'
    RMSNorm), over rows of H."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    v = (tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
         + tl.load(y_ptr + t * stride_y + offs, mask=ok, other=0.0).to(tl.float32))
    if HAS_Z:
        v += tl.load(z_ptr + t * stride_z + offs, mask=ok, other=0.0).to(tl.float32)
    v = v.to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + t * H + offs, v, mask=ok)
    v = v.to(tl.float32)
    n = v * tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    n = n.to(sum_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, (w * n).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_gemv(gu_ptr, w_ptr, out_ptr, N, I, stride_gu, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """out[t, n] = sum_i w[n, i] silu(gu[t, i]) gu[t, I + i] (fp32, stored in out's dtype);
    gu [T, 2I] (gate then up), w [N, I] (down_proj's weight)."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        g = tl.load(gu_ptr + t * stride_gu + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * stride_gu + I + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        x = g * tl.sigmoid(g) * u
        w = tl.load(w_ptr + offs_n[:, None] * I + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + t * N + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
