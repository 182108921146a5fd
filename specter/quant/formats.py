"""Quantized weight matrices: symmetric group-wise integer codes, packing, dequantization.

Owns: the one quantized layout the project uses for a weight matrix W [out, in] (nn.Linear
orientation): `bits`-bit codes q in [0, 2^bits - 1] with a fixed midpoint z = 2^(bits-1),
one scale per (row, group of `group` input columns), and W ~ (q - z) * scale. INT2/INT4/INT8
codes are packed into bytes (8 / bits codes per byte, low bits first); INT3 codes are kept one
per byte (said in `packed_bytes`). Round-to-nearest (RTN) quantization lives here too; GPTQ
(gptq.py) produces the same layout.
Does not own: how codes are chosen beyond RTN (gptq.py) or how they are executed (kernels).

Scale convention (as GPTQ's reference quantizer, sym=True): scale = 2 * max|w| / (2^bits - 1)
per group, so q = clamp(round(w / scale) + z, 0, 2^bits - 1).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def effective_group(in_features: int, group: int) -> int:
    """The group size used for a matrix: `group` if it divides the input width, else the
    largest power of two below it that does (at least 32, the smallest the INT4 kernels
    take), else the whole row; e.g. 192-wide rows of the small models use groups of 64."""
    if in_features % group == 0:
        return group
    g = 1 << (group.bit_length() - 1)
    while g >= 32:
        if in_features % g == 0:
            return g
        g //= 2
    return in_features


@dataclass
class QuantizedMatrix:
    """W [out, in] as codes + scales. `codes` is packed (see `pack_codes`)."""

    codes: torch.Tensor  # uint8 packed codes
    scales: torch.Tensor  # [out, in // group], the model's float dtype
    bits: int
    group: int
    shape: tuple[int, int]  # (out, in)

    @property
    def midpoint(self) -> int:
        return 1 << (self.bits - 1)

    def unpacked(self) -> torch.Tensor:
        """Codes as uint8 [out, in]."""
        return unpack_codes(self.codes, self.bits, self.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The reference path: W_hat [out, in] = (q - z) * scale."""
        out, inp = self.shape
        q = self.unpacked().to(self.scales.dtype) - self.midpoint
        w = q.view(out, inp // self.group, self.group) * self.scales.unsqueeze(-1)
        return w.reshape(out, inp).to(dtype or self.scales.dtype)

    def packed_bytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + \
            self.scales.numel() * self.scales.element_size()

    def to(self, device: torch.device) -> "QuantizedMatrix":
        return QuantizedMatrix(self.codes.to(device), self.scales.to(device), self.bits,
                               self.group, self.shape)


def draft_expert_bytes(hidden: int, inter: int, bits: int, group: int, scale_bytes: int) -> int:
    """One expert quantized (this module's layout): gate_up [2I, H] and down [H, I] as
    codes (`bits` per weight; INT3 one byte each) and one scale per row and group of input
    columns, in the model's dtype."""
    code_bytes = (lambda w: w) if bits == 3 else (lambda w: w * bits // 8)
    codes = code_bytes(2 * inter * hidden) + code_bytes(hidden * inter)
    scales = 2 * inter * (hidden // effective_group(hidden, group)) \
        + hidden * (inter // effective_group(inter, group))
    return codes + scales * scale_bytes


def _per_byte(bits: int) -> int:
    return 8 // bits if bits in (2, 4, 8) else 1


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> packed uint8 [out, in / per_byte] (low bits first)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    per = _per_byte(bits)
    q = q.to(torch.uint8)
    if per == 1:
        return q.contiguous()
    out, inp = q.shape
    if inp % per:
        raise ValueError(f"in_features {inp} is not a multiple of {per} for {bits}-bit packing")
    q = q.view(out, inp // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    return (q << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    per = _per_byte(bits)
    if per == 1:
        return packed.view(shape)
    out, inp = shape
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(out, inp).to(torch.uint8)


def group_scales(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Scale of each row of `w` [out, g]: 2 * max|w| / (2^bits - 1), never zero."""
    maxq = (1 << bits) - 1
    scale = 2 * w.abs().amax(dim=1) / maxq
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `w` [out, n] with per-row `scale` [out]: round(w / s) + z, clamped."""
    maxq = (1 << bits) - 1
    return torch.clamp(torch.round(w / scale.unsqueeze(1)) + (1 << (bits - 1)), 0, maxq)


def rtn_quantize(w: torch.Tensor, bits: int, group: int, rows: int = 128) -> QuantizedMatrix:
    """Round-to-nearest, group-wise symmetric. `rows` rows at a time (each row's codes and
    scales depend on that row alone: the same result as the whole matrix at once), so its
    float32 temporaries are a block's, not the matrix's (a DeepSeek-V2-Lite gate_up is 23 MB
    in float32, and the dozen such temporaries of each of 1,664 experts left the host's heap
    fragmented)."""
    out, inp = w.shape
    g = effective_group(inp, group)
    codes = scales = None
    for r in range(0, out, rows):
        wf = w[r:r + rows].float().view(-1, inp // g, g)
        s = 2 * wf.abs().amax(dim=2) / ((1 << bits) - 1)  # [rows, n_groups]
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.clamp(torch.round(wf / s.unsqueeze(-1)) + (1 << (bits - 1)), 0, (1 << bits) - 1)
        c = pack_codes(q.view(-1, inp), bits)
        if codes is None:
            codes = torch.empty((out, c.shape[1]), dtype=c.dtype, device=c.device)
            scales = torch.empty((out, s.shape[1]), dtype=w.dtype, device=c.device)
        codes[r:r + rows] = c
        scales[r:r + rows] = s
        del wf, s, q, c
    return QuantizedMatrix(codes, scales, bits, g, (out, inp))


def weights_checksum(tensors: list[torch.Tensor]) -> str:
    """Identifies the source weights a quantization was made from."""
    return weights_checksum_parts([(tuple(t.shape), [t]) for t in tensors])


def weights_checksum_parts(tensors: list[tuple[tuple[int, ...], list[torch.Tensor]]]) -> str:
    """`weights_checksum` of tensors given in pieces: (shape, the pieces whose bytes, in
    order, are the tensor's), e.g. a fused [E, 2I, H] parameter as E per-expert buffers."""
    h = hashlib.sha256()
    for shape, pieces in tensors:
        h.update(str(tuple(shape)).encode())
        for t in pieces:
            h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
