"""GPTQ (Frantar et al., 2023) for one weight matrix, in the project's quantized layout.

Owns: accumulating the Hessian H = 2/n * sum x x^T of a matrix's inputs, and the GPTQ
column-by-column quantization with error feedback through the Cholesky factor of H^-1
(lazy batch updates in blocks of 128 columns; damping `damp * mean(diag H)`; columns never
seen (zero diagonal) are zeroed; no act-order). Scales are chosen group-wise from the
error-updated weights when each group starts, as the reference implementation does with
`static_groups=False`. One float64 working copy of W, at most two [in, in] factors at a
time, codes kept as uint8: `gptq_working_bytes` states what one matrix holds on its device.
Does not own: which inputs reach which expert (calibrate.py) or execution.
"""

from __future__ import annotations

import torch

from specter.quant.formats import (QuantizedMatrix, effective_group, group_scales, pack_codes,
                                   quantize_codes)


class Hessian:
    """Running H = 2/n * X^T X over input rows x [n, in] (float64 accumulation)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        m = x.shape[0]
        if m == 0:
            return
        self.h *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.h += x.T @ x


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group: int,
                  damp: float = 0.01, block: int = 128) -> QuantizedMatrix:
    """Quantize w [out, in] given H [in, in]; returns codes + scales (w's dtype)."""
    out, cols = w.shape
    g = effective_group(cols, group)
    W = w.detach().to(torch.float64, copy=True)  # the one working copy
    H = hessian.to(torch.float64, copy=True)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))  # H + damp * mean(diag H) * I, in place
    L = torch.linalg.cholesky(H)
    H = None  # each [in, in] factor freed once the next is made: two at a time
    Hinv = torch.cholesky_inverse(L)
    L = None
    Hinv = torch.linalg.cholesky(Hinv, upper=True)
    Q = torch.zeros(out, cols, dtype=torch.uint8, device=W.device)  # codes are small integers
    scales = torch.zeros(out, cols // g, dtype=torch.float64, device=W.device)
    scale = None
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            c = i1 + i
            if c % g == 0:  # a new group: its scale from the current (updated) weights
                cur = W1[:, i:i + g]  # the group's first columns from this block, the rest after it
                if cur.shape[1] < g:
                    cur = torch.cat([cur, W[:, i2:i2 + g - cur.shape[1]]], dim=1)
                scale = group_scales(cur, bits)
                scales[:, c // g] = scale
            col = W1[:, i]
            q = quantize_codes(col.unsqueeze(1), scale, bits).squeeze(1)
            Q[:, c] = q
            deq = (q - (1 << (bits - 1))) * scale
            err = (col - deq) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    W = Hinv = W1 = Hinv1 = Err1 = cur = None  # freed before the codes are packed
    return QuantizedMatrix(pack_codes(Q, bits), scales.to(w.dtype), bits, g, (out, cols))


def gptq_working_bytes(out: int, cols: int, group: int, bits: int = 4, block: int = 128) -> int:
    """The most bytes `gptq_quantize` holds at once on its device for one [out, cols] matrix,
    beyond its inputs: from what it makes, in three phases (the largest counts). Making H's
    factors: the float64 W and two [cols, cols] factors at a time. The column sweep: W, H^-1's
    factor, the uint8 codes, the float64 scales, one block's W1 and Err1, a few column vectors
    and the largest of its passing temporaries (the product that updates the columns after a
    block; a group's |w|, and its columns gathered when the group runs past a block's end;
    one column's rank-1 update). Packing: the codes and `pack_codes`' int32 and int64
    temporaries. Plus 64 (out + cols) for masks and diagonals."""
    g = effective_group(cols, group)
    per = 8 // bits if bits in (2, 4, 8) else 1  # codes a byte (formats.pack_codes)
    b = min(block, cols)
    oc, sc = out * cols, 8 * out * (cols // g)
    setup = 8 * oc + 16 * cols * cols
    passing = max(8 * out * (cols - b), 8 * out * g * (2 if g > b or b % g else 1), 8 * out * b)
    sweep = 8 * oc + 8 * cols * cols + oc + sc + 16 * out * b + 24 * out + passing
    pack = oc + sc + (8 * oc + 8 * oc // per + oc // per if per > 1 else 0)
    return max(setup, sweep, pack) + 64 * (out + cols)


def reconstruction_error(w: torch.Tensor, qm: QuantizedMatrix, hessian: torch.Tensor) -> float:
    """The GPTQ objective per output row: tr((W - W_hat) H (W - W_hat)^T) / out, i.e. the mean
    squared output error on the calibration inputs (H = 2/n X^T X, so halved)."""
    d = (w.to(torch.float64) - qm.dequantize(torch.float64))
    return float(torch.einsum("oi,ij,oj->", d, hessian.to(torch.float64), d) / (2 * w.shape[0]))
