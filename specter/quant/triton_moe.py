"""The fused multi-expert INT4 GEMM, as a plain function for `triton.jit` (kernels.py jits it
once per mode: compiled on CUDA, or interpreted on the CPU with TRITON_INTERPRET=1).

One program computes a BLOCK_M x BLOCK_N tile of out[dst_row] = x[src_row] @ W_e^T for a
block of (token, k-slot) rows that all go to expert e, dequantizing the packed INT4 codes of
W_e (two per byte, low nibble first; w = (q - 8) * scale per group) on the fly, with fp32
accumulation. Rows padded with -1 are masked out.
"""

import triton.language as tl


def moe_int4_gemm(x_ptr, codes_ptr, scales_ptr, out_ptr, src_row_ptr, dst_row_ptr,
                  block_expert_ptr, N, K, stride_xm, stride_ce, stride_cn, stride_se,
                  stride_sn, stride_om, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE_DOT: tl.constexpr):
    """out[dst_row] = x[src_row] @ dequant(W[e]).T for one block of rows routed to e.

    IEEE_DOT: fp32 products on the CUDA cores (fp32 activations). Otherwise tl.dot's default,
    TF32 tensor cores on Ampere and later: a 10-bit mantissa, finer than the bf16/fp16 result's
    own rounding, but on an H200 it put an fp32 run 2.5e-3 (relative to the largest output)
    off the fp32 reference, which an fp32 mode must not be."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    src = tl.load(src_row_ptr + offs_m).to(tl.int64)  # -1: padding
    dst = tl.load(dst_row_ptr + offs_m).to(tl.int64)
    valid = src >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        byte = tl.load(codes_ptr + e * stride_ce + offs_n[:, None] * stride_cn
                       + (offs_k[None, :] // 2), mask=n_ok[:, None] & k_ok[None, :], other=0)
        q = (byte.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF
        s = tl.load(scales_ptr + e * stride_se + offs_n[:, None] * stride_sn
                    + offs_k[None, :] // GROUP, mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - 8.0) * s  # [BLOCK_N, BLOCK_K]
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + dst[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])



def moe_int4_pairs(x_ptr, codes_ptr, scales_ptr, index_ptr, weights_ptr, out_ptr, N, K,
                   stride_xm, stride_ce, stride_cn, stride_se, stride_sn, stride_om,
                   TOPK: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                   SUM: tl.constexpr):
    """out[r, n-block] = the sum over SUM consecutive (token, k-slot) pairs p = r SUM + j of
    x[row] @ dequant(W[e_p]).T (a GEMV: a draft step routes a few tokens, each its own
    expert): e_p = top_k_index.flat[p], read on the device; row = p // TOPK (TOPK = k: the
    token's hidden state for gate_up; 1: the pair's own row for down). SUM = 1: a row a pair;
    SUM = k: a row a token, its k experts summed. Grid (P / SUM, cdiv(N, BLOCK_N)).

    Codes as moe_int4_gemm's ([E, N, K/2], low nibble first, w = (q - 8) * scale per GROUP),
    read a byte at a time: its low code multiplies x[2b], its high code x[2b + 1] (GROUP is
    even, so both share a scale). K is the width of x's row, BLOCK_K is in x's columns.
    GATED: x is gate_up's output [P, 2K]: silu(gate) * up, in fp32, on the fly.
    WEIGHTED: each pair's row times top_k_weights.flat[p]. fp32 accumulation, stored in
    out's dtype."""
    r, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    HALF: tl.constexpr = BLOCK_K // 2
    for j in range(SUM):
        p = r * SUM + j
        e = tl.load(index_ptr + p).to(tl.int64)
        row = (p // TOPK).to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_b = k0 // 2 + tl.arange(0, HALF)  # byte columns
            b_ok = offs_b * 2 < K
            x_row = x_ptr + row * stride_xm
            if GATED:
                g_lo = tl.load(x_row + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)
                g_hi = tl.load(x_row + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)
                u_lo = tl.load(x_row + K + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)
                u_hi = tl.load(x_row + K + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)
                x_lo = g_lo * tl.sigmoid(g_lo) * u_lo
                x_hi = g_hi * tl.sigmoid(g_hi) * u_hi
            else:
                x_lo = tl.load(x_row + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)
                x_hi = tl.load(x_row + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)
            mask = n_ok[:, None] & b_ok[None, :]
            byte = tl.load(codes_ptr + e * stride_ce + offs_n[:, None] * stride_cn
                           + offs_b[None, :], mask=mask, other=0).to(tl.int32)
            s = tl.load(scales_ptr + e * stride_se + offs_n[:, None] * stride_sn
                        + (2 * offs_b[None, :]) // GROUP, mask=mask, other=0.0).to(tl.float32)
            lo = ((byte & 0xF) - 8).to(tl.float32)
            hi = (((byte >> 4) & 0xF) - 8).to(tl.float32)
            acc += tl.sum((lo * x_lo[None, :] + hi * x_hi[None, :]) * s, axis=1)
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + p).to(tl.float32)
        total += acc
    tl.store(out_ptr + r * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def route_topk(x_ptr, w_ptr, logits_ptr, weights_ptr, index_ptr, E, H, stride_x, scale,
               TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's routing (a program per token): its E router logits (x . w_e over the H
    hidden features, in fp32), their softmax, then the TOPK largest probabilities, largest
    first, each times `scale`, and their experts' ids (the first of equal maxima); DeepSeek's
    greedy top-k router, GEMM included."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        x = tl.load(x_ptr + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs[:, None] * H + offs_h[None, :], mask=ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(logits_ptr + t * E + offs, acc, mask=ok)
    x = tl.where(ok, acc, -float("inf"))
    e = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = tl.where(ok, e / tl.sum(e, axis=0), -1.0)
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=0)
        at = tl.argmax(p, axis=0)
        tl.store(weights_ptr + t * TOPK + j, best * scale)
        tl.store(index_ptr + t * TOPK + j, at.to(tl.int64))
        p = tl.where(offs == at, -1.0, p)


def moe_slot_rows(x_ptr, w_ptr, out_ptr, pairs_ptr, ends_ptr, weights_ptr, at_ptr, N, K,
                  stride_xm, stride_ws, stride_wn, stride_om, FIRST: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """One projection of a verification round over the device's expert slots (a bf16/fp16/
    fp32 weight each, offload/grouped.py `expert_round`): program (s, m, n) computes rows
    m BLOCK_M.. of slot s's pairs, columns n BLOCK_N.., against slot s's weight w[s]
    ([N', K] rows `stride_wn` apart, slots `stride_ws`). The round's pairs are listed in slot
    order (`pairs_ptr`, indices into the layer's pairs) and slot s's are rows
    ends[s-1]..ends[s]; a program past its slot's rows reads and writes nothing.

    FIRST (gate_up, w [2N, K]): the rows are x[pairs[r]] (the pairs' hidden states) and row r of
    out is silu(gate) * up, gate and up rounded to out's dtype first, as the eager GEMM, SiLU
    and product round them. Else (down, w [N, K]): the rows are x[r] (the first projection's
    out) and each product, rounded to out's dtype, times its pair's routing weight
    weights[pair] goes to row at[pair] of out (the layer's sum by rank). fp32 accumulation.
    UPCAST: the operands converted to fp32 before each product (Triton's interpreter, whose
    dot does not take bf16; a bf16 product is exact in fp32, so the function is the same)."""
    s, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.load(ends_ptr + s)
    start = tl.where(s > 0, tl.load(ends_ptr + tl.maximum(s - 1, 0)), 0)
    offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < end
    live = start + pid_m * BLOCK_M < end  # this program has rows: else it reads nothing
    n_live = tl.where(live, N, 0)
    k_live = tl.where(live, K, 0)
    pair = tl.load(pairs_ptr + offs_m, mask=valid, other=0).to(tl.int64)
    row = pair if FIRST else offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_live
    w_base = w_ptr + s.to(tl.int64) * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_live, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + row[:, None] * stride_xm + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        if FIRST:
            u = tl.load(w_base + (N + offs_n[:, None]) * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            if IEEE_DOT:
                acc_up += tl.dot(x, tl.trans(u), input_precision="ieee")
            else:
                acc_up += tl.dot(x, tl.trans(u))
    dt = out_ptr.dtype.element_ty
    if FIRST:
        g = acc.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
        h = (act * acc_up.to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], h,
                 mask=valid[:, None] & n_ok[None, :])
    else:
        wt = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        y = (acc.to(x_ptr.dtype.element_ty).to(tl.float32) * wt[:, None]).to(dt)
        at = tl.load(at_ptr + pair, mask=valid, other=0).to(tl.int64)
        tl.store(out_ptr + at[:, None] * stride_om + offs_n[None, :], y,
                 mask=valid[:, None] & n_ok[None, :])
