"""Executing quantized routed experts: one layer's experts applied to the tokens routed to them.

Owns: four interchangeable backends with the same call
`backend(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`:
- `reference`: dequantize each needed expert, then ordinary matmuls (any bits, any device):
  the definition the others are tested against.
- `cpu_int4`: torch's CPU INT4 GEMM (`_weight_int4pack_mm_for_cpu`), weights repacked once
  into its layout (INT4 only, groups of 32 to 256).
- `cuda_int4`: its CUDA twin (`_weight_int4pack_mm`, tinygemm), per expert, bf16 activations.
- `triton`: a fused multi-expert INT4 GEMM in Triton: every routed expert of a layer in one
  launch per projection, (token, k-slot) pairs gathered by expert into blocks of BLOCK_M
  rows (INT4 only). Runs on CUDA, and on the CPU under `TRITON_INTERPRET=1` for tests.
All accumulate in fp32. Results are summed in expert-id order, (k-slot, token) order within
an expert, as Hugging Face's eager experts loop does.
Does not own: quantization (gptq.py, formats.py) or when the draft runs (draft.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from specter.errors import UserError
from specter.grouping import group_by_expert
from specter.quant.formats import QuantizedMatrix

BACKENDS = ("reference", "cpu_int4", "cuda_int4", "triton")


def _route(top_k_index: torch.Tensor, num_experts: int):
    """Per needed expert (ascending): (k-slot positions, token indices) in HF's order, from
    one read of the routing (specter/grouping.py)."""
    groups = group_by_expert(top_k_index, num_experts)
    for e in groups.needed:
        pos, token_idx = groups.of(e)
        yield e, pos, token_idx


class ReferenceExperts:
    """Dequantize-then-matmul over one layer's quantized experts."""

    def __init__(self, gate_up: list[QuantizedMatrix], down: list[QuantizedMatrix], act):
        self.gate_up, self.down, self.act = gate_up, down, act
        self.num_experts = len(gate_up)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = self.act(nn.functional.linear(x, self.gate_up[e].dequantize(x.dtype)))
        return nn.functional.linear(h, self.down[e].dequantize(x.dtype))

    def __call__(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        final = torch.zeros_like(hidden)
        for e, pos, token_idx in _route(top_k_index, self.num_experts):
            y = self.expert(e, hidden[token_idx])
            final.index_add_(0, token_idx, (y * top_k_weights[token_idx, pos, None]).to(final.dtype))
        return final


def _check_int4(mats: list[QuantizedMatrix], backend: str) -> None:
    """torch's INT4 GEMMs take 4-bit codes in groups of 32 to 256: one sentence otherwise."""
    for qm in mats:
        if qm.bits != 4 or qm.group not in (32, 64, 128, 256):
            raise UserError(f"the {backend} backend needs 4-bit weights in groups of 32 to 256 "
                            f"(got {qm.bits}-bit, group {qm.group}); use the reference backend.")


def _scales_and_zeros(qm: QuantizedMatrix, dtype: torch.dtype) -> torch.Tensor:
    """[K/g, N, 2] for torch's INT4 GEMMs, w = (q - 8) * scale + zero, with zero = 0."""
    scales = qm.scales.to(dtype).T.contiguous()  # [K/g, N]
    return torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()


def _int4pack_cpu(qm: QuantizedMatrix, dtype: torch.dtype):
    """(packed weight, scales_and_zeros) for `_weight_int4pack_mm_for_cpu` (symmetric)."""
    q = qm.unpacked().to(torch.int32)  # [N, K] in 0..15
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), _scales_and_zeros(qm, dtype)


class CpuInt4Experts(ReferenceExperts):
    """torch's CPU INT4 GEMM per expert."""

    def __init__(self, gate_up, down, act, dtype: torch.dtype = torch.float32):
        super().__init__(gate_up, down, act)
        _check_int4(gate_up + down, "cpu_int4")
        self.dtype = dtype
        self.groups = [(g.group, d.group) for g, d in zip(gate_up, down)]
        self.packed = [(_int4pack_cpu(g, dtype), _int4pack_cpu(d, dtype))
                       for g, d in zip(gate_up, down)]
        self.gate_up = self.down = None  # the packed copy is the one kept

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        (wg, szg), (wd, szd), (gg, gd) = *self.packed[e], self.groups[e]
        xd = x.to(self.dtype)
        h = self.act(torch._weight_int4pack_mm_for_cpu(xd, wg, gg, szg))
        return torch._weight_int4pack_mm_for_cpu(h, wd, gd, szd).to(x.dtype)


def _int4pack_cuda(qm: QuantizedMatrix):
    """(packed weight, bf16 scales_and_zeros) for torch's CUDA INT4 GEMM (`_weight_int4pack_mm`,
    tinygemm): the codes two per byte, the even column in the high nibble, then tiled by
    `_convert_weight_to_int4pack` (the largest inner-K tiling that divides K)."""
    q = qm.unpacked().to(torch.int32)  # [N, K] in 0..15
    n, k = q.shape
    tiles = next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)
    if tiles is None or n % 8:
        raise UserError(f"the cuda_int4 backend needs N a multiple of 8 and K of 32 (got an "
                        f"{n}x{k} matrix); use the triton or reference backend.")
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles)
    return packed, _scales_and_zeros(qm, torch.bfloat16)


class CudaInt4Experts(ReferenceExperts):
    """torch's CUDA INT4 GEMM (tinygemm, `_weight_int4pack_mm`) per expert: the CUDA twin of
    `cpu_int4`, three kernels per expert (gate_up, the activation, down) in bf16 activations."""

    def __init__(self, gate_up, down, act, device: torch.device | None = None):
        super().__init__(gate_up, down, act)
        _check_int4(gate_up + down, "cuda_int4")
        device = torch.device(device) if device is not None else gate_up[0].codes.device
        if device.type != "cuda":
            raise UserError("the cuda_int4 backend runs on a CUDA device; use cpu_int4 on the CPU.")
        self.groups = [(g.group, d.group) for g, d in zip(gate_up, down)]
        # one expert at a time to the device and packed there: the packed copy is the one kept
        self.packed = [(_int4pack_cuda(g.to(device)), _int4pack_cuda(d.to(device)))
                       for g, d in zip(gate_up, down)]
        self.gate_up = self.down = None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        (wg, szg), (wd, szd), (gg, gd) = *self.packed[e], self.groups[e]
        xb = x.to(torch.bfloat16)
        h = self.act(torch._weight_int4pack_mm(xb, wg, gg, szg))
        return torch._weight_int4pack_mm(h, wd, gd, szd).to(x.dtype)


# -- Triton ----------------------------------------------------------------------------------
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_KERNELS: dict[bool, object] = {}


def _kernel():
    """Build the Triton kernel on first use (importing triton is slow and optional); one per
    mode, since `triton.jit` reads TRITON_INTERPRET when it decorates."""
    key = interpret_mode()
    if key in _KERNELS:
        return _KERNELS[key]
    import triton

    from specter.quant import triton_moe

    moe_int4_gemm = triton.jit(triton_moe.moe_int4_gemm)
    _KERNELS[key] = moe_int4_gemm
    return moe_int4_gemm


def align_blocks(top_k_index: torch.Tensor, block_m: int, num_experts: int):
    """Group (token, k-slot) pairs by expert into blocks of `block_m` rows, padded with -1,
    on the device and without a host read: the shapes depend only on T, k, the expert count
    and `block_m` (every expert's rows padded to whole blocks fit in P + min(E, P) (block_m - 1)
    rows, P = T k; blocks past the last expert's hold only -1 and name the last expert).
    Returns (pair ids [blocks * block_m], expert of each block [blocks]); a pair id p is
    token p // k, slot p % k. Within an expert pairs keep (k-slot, token) order."""
    T, k = top_k_index.shape
    P, dev = T * k, top_k_index.device
    flat = top_k_index.T.reshape(-1)  # slot-major: (k-slot, token) order
    pair_ids = (torch.arange(T, device=dev).repeat(k) * k
                + torch.arange(k, device=dev).repeat_interleave(T))
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = torch.cumsum(padded, 0)
    src_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(P, device=dev) - src_starts[sorted_e]  # place within its expert
    n_rows = -(-(P + min(num_experts, P) * (block_m - 1)) // block_m) * block_m
    rows = torch.full((n_rows,), -1, dtype=torch.int64, device=dev)
    rows[pad_ends[sorted_e] - padded[sorted_e] + rank] = pair_ids[order]
    block_start = torch.arange(0, n_rows, block_m, device=dev)
    block_expert = torch.searchsorted(pad_ends, block_start, right=True).clamp_(max=num_experts - 1)
    return rows, block_expert.to(torch.int32)


class TritonExperts:
    """All of a layer's routed experts in one Triton launch per projection (INT4)."""

    BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32

    def __init__(self, gate_up: list[QuantizedMatrix], down: list[QuantizedMatrix], act,
                 device: torch.device | None = None):
        """`device`: where the stacked codes go (stacked where the matrices are, then moved:
        one device copy); None: the matrices' own device."""
        if not triton_available():
            raise UserError("the triton backend needs the triton package (a GPU extra: "
                            "pip install -e .[gpu]); use the reference or cpu_int4 backend.")
        for qm in gate_up + down:
            if qm.bits != 4:
                raise UserError(f"the triton backend runs 4-bit weights only (got {qm.bits}-bit).")
        self.act = act
        dev = device if device is not None else gate_up[0].codes.device
        self.gu_codes = torch.stack([m.codes for m in gate_up]).to(dev)  # [E, 2I, H/2]
        self.gu_scales = torch.stack([m.scales for m in gate_up]).to(dev)  # [E, 2I, H/g]
        self.dn_codes = torch.stack([m.codes for m in down]).to(dev)
        self.dn_scales = torch.stack([m.scales for m in down]).to(dev)
        self.gu_group, self.dn_group = gate_up[0].group, down[0].group

    def _gemm(self, x, codes, scales, group, block_expert, src_rows, out_rows, n_out, ieee):
        E, N, _ = codes.shape
        K = x.shape[1]
        out = torch.zeros(n_out, N, dtype=torch.float32, device=x.device)  # fp32 intermediates
        grid = (block_expert.numel(), (N + self.BLOCK_N - 1) // self.BLOCK_N)
        _kernel()[grid](x, codes, scales, out, src_rows, out_rows, block_expert, N, K,
                        x.stride(0), codes.stride(0), codes.stride(1), scales.stride(0),
                        scales.stride(1), out.stride(0), GROUP=group, BLOCK_M=self.BLOCK_M,
                        BLOCK_N=self.BLOCK_N, BLOCK_K=self.BLOCK_K, IEEE_DOT=ieee)
        return out

    def __call__(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        T, k = top_k_index.shape
        pairs, block_expert = align_blocks(top_k_index, self.BLOCK_M, self.gu_codes.shape[0])
        token_rows = torch.where(pairs >= 0, pairs // k, pairs)
        exact = hidden.dtype == torch.float32  # fp32 in, fp32 products (IEEE_DOT)
        h = self._gemm(hidden, self.gu_codes, self.gu_scales, self.gu_group, block_expert,
                       token_rows, pairs, T * k, exact)  # [T*k, 2I]
        h = self.act(h)
        y = self._gemm(h, self.dn_codes, self.dn_scales, self.dn_group, block_expert,
                       pairs, pairs, T * k, exact)  # [T*k, H]
        # fp32 from the GEMMs through the activation and the weighted sum; one rounding at the end
        return (y.view(T, k, -1) * top_k_weights.unsqueeze(-1).float()).sum(dim=1).to(hidden.dtype)


def make_experts(backend: str, gate_up, down, act, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None):
    """One MoE layer's draft experts on `backend`, its matrices moved to `device` (None: where
    they are) so that the device holds one copy: the backend's own layout."""
    if backend == "reference":
        if device is not None:
            gate_up, down = [m.to(device) for m in gate_up], [m.to(device) for m in down]
        return ReferenceExperts(gate_up, down, act)
    if backend == "cpu_int4":
        if device is not None and torch.device(device).type != "cpu":
            raise UserError("the cpu_int4 backend runs on the CPU; use cuda_int4 or triton on "
                            "a GPU.")
        return CpuInt4Experts(gate_up, down, act, dtype)
    if backend == "cuda_int4":
        return CudaInt4Experts(gate_up, down, act, device)
    if backend == "triton":
        return TritonExperts(gate_up, down, act, device)
    raise UserError(f"unknown INT4 backend '{backend}'; choose one of: {', '.join(BACKENDS)}.")


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
