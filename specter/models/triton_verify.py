"""Verification's attention for DeepSeek-V2 in one kernel, as a plain function for `triton.jit`
(quant/kernels.py `_kernel` jits it once per mode: compiled on CUDA, or interpreted on the CPU
with TRITON_INTERPRET=1); decoding/verify_pieces.py `specter::mla_attend` launches it.

`mla_verify` (a program per row and head): multi-head latent attention of a window's W
queries over the whole cache, as transformers computes it over the cache, not absorbed: for
each block of cached positions, kv_b_proj's key and value rows applied to the latents
(rounded to the model's dtype, as its GEMM's output is), the scores of the W queries against
the no-rope keys and the rotary keys, times `scaling`, the mask (boolean: attend where true;
else added), an online softmax, and the values summed (the probabilities rounded to the
model's dtype first, as a flash kernel does). fp32 accumulation. What transformers runs as
kv_b_proj over every position, the key's assembly, SDPA and its layout copy is one launch.
"""

import triton.language as tl


def mla_verify(q_ptr, lat_ptr, pe_ptr, w_ptr, mask_ptr, out_ptr, W, L, scaling,
               s_qb, s_qh, s_qw, s_lb, s_lt, s_pb, s_pt, s_mb, s_mw, s_mt, s_ob, s_ow,
               R: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
               BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr,
               HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, IEEE_DOT: tl.constexpr,
               UPCAST: tl.constexpr):
    """q [B, H, W, DN + DR] (the queries, rope part rotated); lat [B, L, R], pe [B, L, DR]
    (the cache, row strides s_lt, s_pt); w = kv_b_proj's weight [H (DN + DV), R]; mask
    [B, W, L] by strides (s_mb = 0: one for every row) -> out [B, W, H DV]. UPCAST: the
    operands in fp32 before each product (the interpreter's dot takes no bf16; the same
    function). IEEE_DOT: fp32 products on the CUDA cores (an fp32 model)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    offs_w = tl.arange(0, BLOCK_W)
    w_ok = offs_w < W
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_dr = tl.arange(0, BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    dn_ok, dr_ok, dv_ok = offs_dn < DN, offs_dr < DR, offs_dv < DV
    q_row = q_ptr + b * s_qb + h * s_qh + offs_w[:, None] * s_qw
    q_nope = tl.load(q_row + offs_dn[None, :], mask=w_ok[:, None] & dn_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + DN + offs_dr[None, :], mask=w_ok[:, None] & dr_ok[None, :],
                   other=0.0)
    if UPCAST:
        q_nope, q_pe = q_nope.to(tl.float32), q_pe.to(tl.float32)
    wk = w_ptr + h * (DN + DV) * R  # this head's key rows, then its value rows
    wv = wk + DN * R
    m_i = tl.full((BLOCK_W,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_W,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_W, BLOCK_DV), dtype=tl.float32)
    for t0 in range(0, L, BLOCK_L):
        offs_t = t0 + tl.arange(0, BLOCK_L)
        t_ok = offs_t < L
        k = tl.zeros((BLOCK_L, BLOCK_DN), dtype=tl.float32)
        v = tl.zeros((BLOCK_L, BLOCK_DV), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            lat = tl.load(lat_ptr + b * s_lb + offs_t[:, None] * s_lt + offs_r[None, :],
                          mask=t_ok[:, None] & r_ok[None, :], other=0.0)
            k_w = tl.load(wk + offs_dn[:, None] * R + offs_r[None, :],
                          mask=dn_ok[:, None] & r_ok[None, :], other=0.0)
            v_w = tl.load(wv + offs_dv[:, None] * R + offs_r[None, :],
                          mask=dv_ok[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                lat, k_w, v_w = lat.to(tl.float32), k_w.to(tl.float32), v_w.to(tl.float32)
            if IEEE_DOT:
                k += tl.dot(lat, tl.trans(k_w), input_precision="ieee")
                v += tl.dot(lat, tl.trans(v_w), input_precision="ieee")
            else:
                k += tl.dot(lat, tl.trans(k_w))
                v += tl.dot(lat, tl.trans(v_w))
        # kv_b_proj's output, as the model's dtype holds it
        k = k.to(dt)
        v = v.to(dt)
        pe = tl.load(pe_ptr + b * s_pb + offs_t[:, None] * s_pt + offs_dr[None, :],
                     mask=t_ok[:, None] & dr_ok[None, :], other=0.0)
        if UPCAST:
            k, v, pe = k.to(tl.float32), v.to(tl.float32), pe.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q_nope, tl.trans(k), input_precision="ieee") \
                + tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
        else:
            s = tl.dot(q_nope, tl.trans(k)) + tl.dot(q_pe, tl.trans(pe))
        s = s * scaling
        if HAS_MASK:
            m = tl.load(mask_ptr + b * s_mb + offs_w[:, None] * s_mw + offs_t[None, :] * s_mt,
                        mask=w_ok[:, None] & t_ok[None, :], other=0)
            if MASK_BOOL:
                s = tl.where(m != 0, s, float("-inf"))
            else:
                s = s + m.to(tl.float32)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(dt)
        if UPCAST:
            p = p.to(tl.float32)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)  # a fully masked row: 0
    tl.store(out_ptr + b * s_ob + offs_w[:, None] * s_ow + h * DV + offs_dv[None, :],
             out.to(dt), mask=w_ok[:, None] & dv_ok[None, :])
