"""Executing quantized routed experts: one layer's experts applied to the tokens routed to them.

Owns: six interchangeable backends with the same call
`backend(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`:
- `reference`: dequantize each needed expert, then ordinary matmuls (any bits, any device):
  the definition the others are tested against.
- `cpu_int4`: torch's CPU INT4 GEMM (`_weight_int4pack_mm_for_cpu`), weights repacked once
  into its layout (INT4 only, groups of 32 to 256).
- `cuda_int4`: its CUDA twin (`_weight_int4pack_mm`, tinygemm), per expert, bf16 activations.
- `triton`: a fused multi-expert INT4 GEMM in Triton: every routed expert of a layer in one
  launch per projection, (token, k-slot) pairs gathered by expert into blocks of BLOCK_M
  rows (INT4 only). Runs on CUDA, and on the CPU under `TRITON_INTERPRET=1` for tests.
- `gather_int4`: plain torch, any device: each (token, k-slot) pair's expert dequantized
  from its gathered INT4 codes, one batched matmul per projection. The same operations at
  every call whatever the routing (shapes from T and k alone) and no host read, so a draft
  step can be captured as a CUDA graph (`GraphedExperts`); calls with more pairs than experts
  (a prefill) go expert by expert instead.
- `fused_int4`: gather_int4's fixed shapes, but each projection one fused Triton GEMV over
  every (token, k-slot) pair reading the packed codes (triton_moe.moe_int4_pairs), both
  inside one custom op (`specter::int4_moe_pairs`) that torch.compile keeps opaque and a CUDA
  graph captures; on the CPU the op's body is the same arithmetic in torch (eager: slower
  than gather_int4 compiled, quant/build.py FUSED_CPU_WHY). Prefills as gather_int4's.
The per-expert backends accumulate in fp32 and sum in expert-id order, (k-slot, token) order
within an expert, as Hugging Face's eager experts loop does; `triton` and `gather_int4` sum
each token's k slots in slot order (a draft's numerics: verification decides the output).
`GraphedExperts` wraps a fixed-shape backend (`triton`, `gather_int4`) on CUDA: each call
shape is captured once and replayed (one graph launch instead of the layer's kernels).
Each backend's `nbytes()` is what it holds: the storages of the tensors it keeps, each
counted once (`cuda_int4` and `cpu_int4` keep their scales twice over, as scales and zeros);
`layers_nbytes(layers)` sums a draft's layers: the draft's device bytes the engine reports.
Does not own: quantization (gptq.py, formats.py) or when the draft runs (draft.py).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from specter.counting import cuda_graph_kernels, launched
from specter.errors import UserError
from specter.grouping import group_by_expert
from specter.quant.formats import QuantizedMatrix, unpack_codes

BACKENDS = ("reference", "cpu_int4", "cuda_int4", "triton", "gather_int4", "fused_int4")
# Backends whose call issues the same kernels whatever the routing: CUDA graphs can replay them.
FIXED_SHAPE = ("triton", "gather_int4", "fused_int4")
# Backends whose draft step compiles whole (spec.compile): no host read, no data-dependent
# shape, and every operation traced (or one opaque custom op, `fused_int4`).
COMPILES = ("gather_int4", "fused_int4")



def held_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage counted once (views share one)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        key = (st.device, st.data_ptr())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def layers_nbytes(layers) -> int:
    """What a draft's backend layers hold, a storage shared between layers counted once."""
    return held_bytes(t for layer in layers for t in layer.tensors())


def cuda_int4_bytes(n: int, k: int, group: int) -> int:
    """Bytes `cuda_int4` holds for one [n, k] matrix: tinygemm's packed weight, int32
    [n/8, k/(16 t), 32, t/2] (k/2 bytes a row whatever the tiling t), and bf16
    scales_and_zeros [k/group, n, 2]."""
    return n * k // 2 + (k // group) * n * 2 * 2


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

    def tensors(self):
        """Every tensor this layer keeps."""
        return [t for qm in self.gate_up + self.down for t in (qm.codes, qm.scales)]

    def nbytes(self) -> int:
        return held_bytes(self.tensors())

    def fixed_shape(self, tokens: int, k: int) -> bool:
        """Whether a call of `tokens` tokens routed to `k` experts each issues the same
        operations whatever the routing, with no host read (a CUDA graph can capture it):
        not here, where the routing is read on the host (`_route`)."""
        return False

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


PACK_ROWS = 128  # rows packed at once: a multiple of torch's CPU INT4 packing's 64-row blocks


def _int4pack_cpu(qm: QuantizedMatrix, dtype: torch.dtype, rows: int = PACK_ROWS):
    """(packed weight, scales_and_zeros) for `_weight_int4pack_mm_for_cpu` (symmetric). torch's
    CPU packing [N, K/2] rearranges codes within blocks of 64 rows only, so it runs `rows`
    rows at a time (a multiple of 64): the same bytes as the whole matrix at once (tested,
    tests/test_host_memory.py), with a block's int32 temporaries instead of the matrix's."""
    n, k = qm.shape
    packed = None
    for r in range(0, n, rows):
        block = unpack_codes(qm.codes[r:r + rows], qm.bits, (min(rows, n - r), k))
        p = torch._convert_weight_to_int4pack_for_cpu(block.to(torch.int32), 1)  # 0..15
        if packed is None:
            packed = torch.empty((n, *p.shape[1:]), dtype=p.dtype, device=p.device)
        packed[r:r + rows] = p
        del block, p
    return packed, _scales_and_zeros(qm, dtype)


class CpuInt4Experts(ReferenceExperts):
    """torch's CPU INT4 GEMM per expert."""

    def __init__(self, gate_up, down, act, dtype: torch.dtype = torch.float32):
        super().__init__(gate_up, down, act)
        _check_int4(gate_up + down, "cpu_int4")
        self.dtype = dtype
        self.groups = [(g.group, d.group) for g, d in zip(gate_up, down)]
        # Into one tensor per part for the whole layer ([E, ...], `_per_layer`), not one
        # allocation per expert: each expert's packing makes temporaries several times its
        # size, and kept pieces between them would pin the freed ones in the heap.
        self.packed = _per_layer(len(gate_up), ((_int4pack_cpu(g, dtype), _int4pack_cpu(d, dtype))
                                                for g, d in zip(gate_up, down)))
        self.gate_up = self.down = None  # the packed copy is the one kept

    def tensors(self):
        return [t for pair in self.packed for packed in pair for t in packed]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        (wg, szg), (wd, szd), (gg, gd) = *self.packed[e], self.groups[e]
        xd = x.to(self.dtype)
        h = self.act(torch._weight_int4pack_mm_for_cpu(xd, wg, gg, szg))
        return torch._weight_int4pack_mm_for_cpu(h, wd, gd, szd).to(x.dtype)


def _per_layer(n: int, experts) -> list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
    """`n` experts' tensors, ((a, b), (c, d)) each, made one at a time by the iterable
    `experts`, copied into one tensor [n, ...] per position (allocated at the first expert)
    and returned as the same nested pairs of views into those."""
    bufs: list[torch.Tensor] | None = None
    views = []
    for e, ((a, b), (c, d)) in enumerate(experts):
        leaves = (a, b, c, d)
        if bufs is None:
            bufs = [torch.empty((n, *t.shape), dtype=t.dtype, device=t.device) for t in leaves]
        if any(t.shape != buf.shape[1:] or t.dtype != buf.dtype for t, buf in zip(leaves, bufs)):
            raise ValueError(f"expert {e}'s packed tensors differ in shape from expert 0's")
        for buf, t in zip(bufs, leaves):
            buf[e].copy_(t)
        del a, b, c, d, leaves  # this expert's temporaries, before the next expert's
        views.append(((bufs[0][e], bufs[1][e]), (bufs[2][e], bufs[3][e])))
    return views


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

    def tensors(self):  # cuda_int4_bytes per matrix
        return [t for pair in self.packed for packed in pair for t in packed]

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


_KERNELS: dict[tuple[str, str, bool], object] = {}


def _kernel(name: str = "moe_int4_gemm", module: str = "specter.quant.triton_moe"):
    """Build a Triton kernel (a plain function of `module`: triton_moe.py, or the draft step's
    models/triton_draft.py) on first use (importing triton is slow and optional); one per mode,
    since `triton.jit` reads TRITON_INTERPRET when it decorates."""
    key = (module, name, interpret_mode())
    if key in _KERNELS:
        return _KERNELS[key]
    import importlib

    import triton

    kernel = triton.jit(getattr(importlib.import_module(module), name))
    _KERNELS[key] = kernel
    return kernel


UNBUILT: set[str] = set()  # ops whose Triton kernel failed to build on this GPU


def fused_or_torch(name: str, use_triton: bool, launch, body, *args):
    """`launch(*args)` (a custom op's Triton kernel) where `use_triton`, else `body(*args)`
    (its torch formulation). A kernel that does not build on this GPU (Triton's compilation
    error, or more registers or shared memory than it has) is said once and the op runs its
    torch formulation from then on: slower, the same values within rounding, and on CUDA a
    captured graph counts the kernels that really run. Under the interpreter (tests) nothing
    is caught."""
    if use_triton and name not in UNBUILT:
        try:
            return launch(*args)
        except build_errors() as err:
            UNBUILT.add(name)
            import warnings

            warnings.warn(f"specter::{name}: its Triton kernel does not build here "
                          f"({type(err).__name__}: {str(err)[:200]}); its torch formulation "
                          "runs instead", RuntimeWarning, stacklevel=2)
    return body(*args)


def build_errors() -> tuple[type, ...]:
    """The errors that say a Triton kernel does not build on this GPU (none when interpreted)."""
    if interpret_mode():
        return ()
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return (CompilationError, OutOfResources)


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
        # codes [E, N, K/2], scales [E, N, K/g]
        self.gu_codes, self.gu_scales, self.gu_group = _stack(gate_up, dev, "triton")
        self.dn_codes, self.dn_scales, self.dn_group = _stack(down, dev, "triton")

    def tensors(self):
        return [self.gu_codes, self.gu_scales, self.dn_codes, self.dn_scales]

    def nbytes(self) -> int:
        return held_bytes(self.tensors())

    def fixed_shape(self, tokens: int, k: int) -> bool:
        """Every call (`align_blocks`: shapes from T, k and the expert count alone)."""
        return True

    def _gemm(self, x, codes, scales, group, block_expert, src_rows, out_rows, n_out, ieee):
        E, N, _ = codes.shape
        K = x.shape[1]
        out = torch.zeros(n_out, N, dtype=torch.float32, device=x.device)  # fp32 intermediates
        grid = (block_expert.numel(), (N + self.BLOCK_N - 1) // self.BLOCK_N)
        launched("triton")
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


# -- gather_int4: fixed shapes in plain torch --------------------------------------------------
def _stack(mats: list[QuantizedMatrix], device, backend: str = "gather_int4"
           ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes [E, N, K/2], scales [E, N, K/g], group) of one projection's experts, stacked where
    they are and then moved (one device copy)."""
    groups = {m.group for m in mats}
    if len(groups) != 1:
        raise UserError(f"the {backend} backend needs one group size per projection (got "
                        f"{sorted(groups)}); use the reference backend.")
    return (torch.stack([m.codes for m in mats]).to(device),
            torch.stack([m.scales for m in mats]).to(device), groups.pop())


def byte_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 2]: a packed byte's two INT4 codes, centred (q - 8), low nibble first."""
    b = torch.arange(256, dtype=torch.int32, device=device)
    return (torch.stack((b & 0xF, b >> 4), dim=-1) - 8).to(dtype)


def _dequantize_stacked(codes: torch.Tensor, scales: torch.Tensor, group: int,
                        table: torch.Tensor) -> torch.Tensor:
    """[P, N, K] weights from packed INT4 codes [P, N, K/2] and scales [P, N, K/g]:
    w = (q - 8) * scale, as QuantizedMatrix.dequantize; both codes of a byte in one lookup
    (`byte_table`), so two kernels per matrix."""
    P, N, half = codes.shape
    q = table[codes.int()]  # [P, N, K/2, 2]
    w = q.view(P, N, -1, group) * scales.unsqueeze(-1)
    return w.view(P, N, 2 * half)


class GatherInt4Experts(ReferenceExperts):
    """Each (token, k-slot) pair's expert dequantized from its gathered INT4 codes, then one
    batched matmul per projection: a fixed sequence of operations (shapes from T and k alone,
    no host read). It dequantizes T*k experts, so a call with more pairs than experts (the
    draft's prefill) goes expert by expert instead (one read of the routing)."""

    def __init__(self, gate_up, down, act, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None):
        super().__init__(gate_up, down, act)
        for qm in gate_up + down:
            if qm.bits != 4:
                raise UserError(f"the gather_int4 backend runs 4-bit weights only (got "
                                f"{qm.bits}-bit); use the reference backend.")
        dev = device if device is not None else gate_up[0].codes.device
        self.dtype = dtype
        self.gu_codes, self.gu_scales, self.gu_group = _stack(gate_up, dev)
        self.dn_codes, self.dn_scales, self.dn_group = _stack(down, dev)
        self.gu_scales, self.dn_scales = self.gu_scales.to(dtype), self.dn_scales.to(dtype)
        self.table = byte_table(dtype, dev)
        self.gate_up = self.down = None  # the stacked copy is the one kept

    def tensors(self):
        return [self.gu_codes, self.gu_scales, self.dn_codes, self.dn_scales, self.table]

    def fixed_shape(self, tokens: int, k: int) -> bool:
        """Up to one (token, k-slot) pair per expert; more go expert by expert, reading the
        routing on the host (DeepSeek-V2-Lite's 64 experts, top 6: 11 tokens and more, a
        second instance's catch-up at K >= 10)."""
        return tokens * k <= self.num_experts

    def _weights(self, experts: torch.Tensor | slice, gate_up: bool) -> torch.Tensor:
        codes, scales, group = ((self.gu_codes, self.gu_scales, self.gu_group) if gate_up
                                else (self.dn_codes, self.dn_scales, self.dn_group))
        return _dequantize_stacked(codes[experts], scales[experts], group, self.table)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        one = slice(e, e + 1)  # a view: no index tensor to upload
        xd = x.to(self.dtype)
        h = self.act(nn.functional.linear(xd, self._weights(one, True)[0]))
        return nn.functional.linear(h, self._weights(one, False)[0]).to(x.dtype)

    def __call__(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        T, k = top_k_index.shape
        if not self.fixed_shape(T, k):
            return super().__call__(hidden, top_k_index, top_k_weights)
        pairs = top_k_index.reshape(-1)  # pair p: token p // k, slot p % k
        x = hidden.to(self.dtype).unsqueeze(1).expand(T, k, -1).reshape(T * k, 1, -1)
        h = self.act(torch.bmm(x, self._weights(pairs, True).transpose(1, 2)))  # [P, 1, I]
        y = torch.bmm(h, self._weights(pairs, False).transpose(1, 2)).view(T, k, -1)
        return (y * top_k_weights.to(self.dtype).unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


# -- fused_int4: one fused Triton GEMV per projection, an opaque custom op ---------------------
FUSED_BLOCK_N, FUSED_BLOCK_K = 32, 64


def _pairs_launch(x, codes, scales, group, top_k_index, top_k_weights, topk: int, gated: bool,
                  weighted: bool, summed: int = 1, dtype=torch.float32) -> torch.Tensor:
    """One launch of triton_moe.moe_int4_pairs: [P / summed, N] in `dtype`, P =
    top_k_index.numel(); `summed` consecutive pairs summed into a row (a token's k)."""
    P, (E, N, half) = top_k_index.numel(), codes.shape
    K = x.shape[1] // 2 if gated else x.shape[1]
    out = torch.empty(P // summed, N, dtype=dtype, device=x.device)  # every element written
    grid = (P // summed, (N + FUSED_BLOCK_N - 1) // FUSED_BLOCK_N)
    launched("triton")
    _kernel("moe_int4_pairs")[grid](
        x, codes, scales, top_k_index, top_k_weights, out, N, K, x.stride(0), codes.stride(0),
        codes.stride(1), scales.stride(0), scales.stride(1), out.stride(0), TOPK=topk,
        GROUP=group, BLOCK_N=FUSED_BLOCK_N, BLOCK_K=FUSED_BLOCK_K, GATED=gated,
        WEIGHTED=weighted, SUM=summed)
    return out


def _pairs_torch(x, codes, scales, group, top_k_index, top_k_weights, topk: int, gated: bool,
                 weighted: bool, summed: int = 1, dtype=torch.float32) -> torch.Tensor:
    """`_pairs_launch` in torch (the CPU's): each pair's expert dequantized in fp32, one bmm."""
    idx = top_k_index.reshape(-1)
    x = x.float()
    if gated:
        g, u = x.chunk(2, dim=-1)
        x = nn.functional.silu(g) * u
    if topk > 1:
        x = x.repeat_interleave(topk, dim=0)  # pair p reads token p // topk
    table = byte_table(torch.float32, x.device)
    w = _dequantize_stacked(codes[idx], scales[idx].float(), group, table)  # [P, N, K]
    out = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    if weighted:
        out = out * top_k_weights.reshape(-1, 1).float()
    if summed > 1:
        out = out.view(-1, summed, out.shape[-1]).sum(dim=1)
    return out.to(dtype)


@torch.library.custom_op("specter::int4_moe_pairs", mutates_args=())
def int4_moe_pairs(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gu_codes: torch.Tensor, gu_scales: torch.Tensor, dn_codes: torch.Tensor,
                   dn_scales: torch.Tensor, gu_group: int, dn_group: int,
                   use_triton: bool) -> torch.Tensor:
    """A layer's routed experts, SiLU-gated: [T, H] in hidden's dtype, each token's k expert
    outputs times their routing weights, summed in fp32 (the down projection's kernel sums
    them: no kernel after it). `use_triton`: two launches of the fused INT4 GEMV (CUDA, or
    the CPU under TRITON_INTERPRET=1); else the same in torch."""
    T, k = top_k_index.shape
    idx, w = top_k_index.contiguous(), top_k_weights.contiguous()
    run = _pairs_launch if use_triton else _pairs_torch
    h = run(hidden.contiguous(), gu_codes, gu_scales, gu_group, idx, w, k, False, False)
    return run(h, dn_codes, dn_scales, dn_group, idx, w, 1, True, True, k, hidden.dtype)


@int4_moe_pairs.register_fake
def _(hidden, top_k_index, top_k_weights, gu_codes, gu_scales, dn_codes, dn_scales, gu_group,
      dn_group, use_triton):
    return hidden.new_empty((top_k_index.shape[0], dn_codes.shape[1]))


@torch.library.custom_op("specter::int4_moe_proj", mutates_args=())
def int4_moe_proj(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  codes: torch.Tensor, scales: torch.Tensor, group: int, topk: int,
                  weighted: bool, use_triton: bool) -> torch.Tensor:
    """One projection of `int4_moe_pairs` alone (one launch): for an expert activation other
    than SiLU-gating, applied in torch between gate_up and down. [T k, N] fp32."""
    run = _pairs_launch if use_triton else _pairs_torch
    return run(x.contiguous(), codes, scales, group, top_k_index.contiguous(),
               top_k_weights.contiguous(), topk, False, weighted)


@int4_moe_proj.register_fake
def _(x, top_k_index, top_k_weights, codes, scales, group, topk, weighted, use_triton):
    return x.new_empty((top_k_index.numel(), codes.shape[1]), dtype=torch.float32)


def silu_gated(act) -> bool:
    """Whether `act` (an HF experts module's bound `_apply_gate`) is transformers' default
    gate, silu(gate) * up with its `act_fn` SiLU: what the fused kernel computes itself."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    owner = getattr(act, "__self__", None)
    return (getattr(act, "__func__", None) is _default_apply_gate
            and isinstance(getattr(owner, "act_fn", None), (nn.SiLU, SiLUActivation)))


class FusedInt4Experts(GatherInt4Experts):
    """Every (token, k-slot) pair's expert in one fused Triton GEMV per projection, reading
    the packed INT4 codes (half a byte a weight) instead of writing each pair's dequantized
    weights out (gather_int4), inside one custom op (`specter::int4_moe_pairs`, two launches)
    that torch.compile treats as one opaque call and a CUDA graph captures. The same shapes
    from T and k alone; a call with more pairs than experts (a prefill) goes expert by expert
    as gather_int4's. On the CPU, unless `use_triton` (the interpreter, in tests), the op
    computes the same in torch. An activation other than SiLU-gating: two ops
    (`int4_moe_proj`), the activation in torch between them."""

    def __init__(self, gate_up, down, act, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, use_triton: bool | None = None):
        super().__init__(gate_up, down, act, dtype, device)
        if self.gu_group % 2 or self.dn_group % 2:  # a byte's two codes share a scale
            raise UserError(f"the fused_int4 backend needs even group sizes (got "
                            f"{self.gu_group}, {self.dn_group}); use gather_int4.")
        if use_triton is None:
            use_triton = self.gu_codes.device.type == "cuda" and triton_available()
        self.use_triton, self.gated = use_triton, silu_gated(act)

    def __call__(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        T, k = top_k_index.shape
        if not self.fixed_shape(T, k):
            return super().__call__(hidden, top_k_index, top_k_weights)
        if self.gated:  # summed and cast inside the op
            return torch.ops.specter.int4_moe_pairs(
                hidden, top_k_index, top_k_weights, self.gu_codes, self.gu_scales,
                self.dn_codes, self.dn_scales, self.gu_group, self.dn_group, self.use_triton)
        proj = torch.ops.specter.int4_moe_proj
        h = proj(hidden, top_k_index, top_k_weights, self.gu_codes, self.gu_scales,
                 self.gu_group, k, False, self.use_triton)
        out = proj(self.act(h), top_k_index, top_k_weights, self.dn_codes, self.dn_scales,
                   self.dn_group, 1, True, self.use_triton)
        # outside the op: inductor fuses the sum and the cast into its next kernel
        return out.view(T, k, -1).sum(dim=1).to(hidden.dtype)


# -- CUDA graphs -----------------------------------------------------------------------------
class CapturedGraph:
    """A captured CUDA graph and its outputs: calling it replays the graph (one launch) and
    returns the outputs (static tensors, overwritten by the next replay)."""

    def __init__(self, graph, outputs):
        self.graph, self.outputs = graph, outputs
        # the device's kernels one replay runs (graph_kernels.py; None: not dumped)
        self.kernels = cuda_graph_kernels(graph) if hasattr(graph, "debug_dump") else None

    def __call__(self):
        launched("graph")
        self.graph.replay()
        return self.outputs


def capture_graph(fn, warm, cuda=None, pool=None) -> CapturedGraph:
    """`fn()` (device work only: no host read, no allocation whose size depends on data)
    captured as one CUDA graph. `warm()` runs twice first, on a side stream (allocations,
    torch.compile's code generation, Triton's JIT, cuBLAS's workspaces), and must leave the
    state as it found it. The capture (`torch.cuda.graph`) synchronizes the device once:
    capture at build time or in an untimed warm-up, never in a timed window. `cuda`:
    torch.cuda (a stand-in in tests). `pool`: a memory pool shared with graphs captured
    before (`torch.cuda.graph_pool_handle()`), safe where graphs replay in the order they
    were captured and each graph's outputs are used before an earlier one replays; None: the
    graph's own pool (at least one 2 MiB segment of the caching allocator each)."""
    if cuda is None:
        import torch.cuda as cuda
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):  # warm-up outside the graph
        for _ in range(2):
            warm()
    cuda.current_stream().wait_stream(side)
    graph = cuda.CUDAGraph()
    if hasattr(graph, "enable_debug_mode"):  # keeps the graph for its kernels' count
        graph.enable_debug_mode()
    with cuda.graph(graph, pool=pool):
        outputs = fn()
    return CapturedGraph(graph, outputs)


class GraphedExperts:
    """A fixed-shape backend (FIXED_SHAPE) captured as a CUDA graph once per call shape and
    replayed: the inputs are copied into the graph's own buffers, one replay runs the layer's
    kernels, the output is copied out. Calls with more than `max_tokens` tokens (a prefill),
    or of a shape the inner backend runs with a host read (`fixed_shape`: gather_int4 past
    one pair per expert), run eagerly: a host read inside a capture is an error. CUDA only
    (`cuda`: a stand-in with `capture_graph(fn, warm)` and `is_current_stream_capturing()`
    runs it on the CPU, tests/fake_cuda.py). Each capture synchronizes the device, so the
    engine captures the shapes a draft forward takes at build time (`DraftMode.warm_graphs`),
    not while decoding."""

    def __init__(self, inner, max_tokens: int = 16, cuda=None):
        self.inner, self.max_tokens = inner, max_tokens
        self.cuda = cuda  # None: torch.cuda and `capture_graph`
        self.graphs: dict[tuple, tuple] = {}

    def tensors(self):
        """The inner backend's tensors and each captured graph's input and output buffers
        (the graphs' private pools for their intermediates are not tensors: not counted)."""
        return self.inner.tensors() + [t for graph, static in self.graphs.values()
                                       for t in (*static, graph.outputs)]

    def nbytes(self) -> int:
        return held_bytes(self.tensors())

    def captures(self, tokens: int, k: int) -> bool:
        """Whether a call of `tokens` tokens, `k` experts each, is replayed as a graph."""
        return tokens <= self.max_tokens and self.inner.fixed_shape(tokens, k)

    def _capture(self, hidden, top_k_index, top_k_weights):
        static = (hidden.clone(), top_k_index.clone(), top_k_weights.clone())
        run = lambda: self.inner(*static)  # noqa: E731 (a warm-up changes no state)
        capture = capture_graph if self.cuda is None else self.cuda.capture_graph
        return capture(run, run), static

    def __call__(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        if not self.captures(*top_k_index.shape) \
                or (self.cuda or torch.cuda).is_current_stream_capturing():
            return self.inner(hidden, top_k_index, top_k_weights)
        key = (tuple(hidden.shape), hidden.dtype, tuple(top_k_index.shape), top_k_weights.dtype)
        if key not in self.graphs:
            self.graphs[key] = self._capture(hidden, top_k_index, top_k_weights)
        graph, (h, i, w) = self.graphs[key]
        h.copy_(hidden)
        i.copy_(top_k_index)
        w.copy_(top_k_weights)
        return graph().clone()


def make_experts(backend: str, gate_up, down, act, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, graphs: bool = False):
    """One MoE layer's draft experts on `backend`, its matrices moved to `device` (None: where
    they are) so that the device holds one copy: the backend's own layout. `graphs`: replay
    each call shape as a CUDA graph (FIXED_SHAPE backends on CUDA; see quant/step_form.py)."""
    if graphs:
        if backend not in FIXED_SHAPE:
            raise UserError(f"CUDA graphs replay a fixed-shape backend ({', '.join(FIXED_SHAPE)}),"
                            f" not {backend}.")
        return GraphedExperts(make_experts(backend, gate_up, down, act, dtype, device))
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
    if backend == "gather_int4":
        return GatherInt4Experts(gate_up, down, act, dtype, device)
    if backend == "fused_int4":
        return FusedInt4Experts(gate_up, down, act, dtype, device)
    raise UserError(f"unknown INT4 backend '{backend}'; choose one of: {', '.join(BACKENDS)}.")


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
