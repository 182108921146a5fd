"""A MoE layer's routed experts computed from the device slots in a few fixed launches, summed
per token in expert-id order.

Owns: the arithmetic of a batch of resident experts in a fixed number of launches, however many
experts and tokens it covers: their (token, k-slot) pairs put in slot order (one upload of
host-built indices; the routing is already on the host, `specter/grouping.py`), the slots' GEMMs
as one kernel per projection (`Kernel`), the routing weights, and each product placed at its
token's rank (`LayerSum`); the layer's sum is then k additions in expert-id order, the order
Hugging Face's eager loop adds in (its `index_add_` per expert), so the products and their sums
are those of the per-expert loop (tests/test_grouped.py holds them bitwise on the CPU for
`grouped_mm`, and the tokens for `padded`).
Does not own: which experts are resident or when a batch is computed (offload/runtime.py).

The three kernels (`pick_kernel`):
- `fused`: a round as one custom op, `specter::expert_round` (two launches: gate_up with the
  SiLU gate and product, then down with the routing weight and the place, quant/triton_moe.py
  `moe_slot_rows`, the round's pairs read in place from the layer's slot buffers), for the
  SiLU-gated experts of every supported architecture. Used wherever it runs: on CUDA with
  Triton (any dtype, any capability), and on the CPU, where the op's body is `grouped_mm`'s
  arithmetic in torch (bitwise the per-expert loop, as that kernel's) and the op counter counts
  the two launches a GPU makes. Another activation runs the device's unfused kernel.
- `grouped_mm`: `torch.nn.functional.grouped_mm` over the layer's whole slot buffer with the
  slots' row offsets (an empty slot costs nothing). Used where torch runs it without reading
  the offsets on the host: the CPU, and CUDA in bfloat16 on compute capability 9.x / 10.x
  (torch's CUTLASS kernel). Elsewhere on CUDA (float16, or an A100) torch falls back to a loop
  over the groups that copies the offsets to the host: a sync per call, so it is not used there.
- `padded`: one `bmm` per projection over the span of slots the batch occupies, each slot's
  tokens padded to the batch's largest count (the padding rows are computed and dropped). Any
  device and dtype; it reads every slot in the span, used or not (for DeepSeek-V2-Lite at 13
  slots, at most 13 experts' weights per batch: 0.2 GB at 4.8 TB/s is 46 us).
"""

from __future__ import annotations

import torch
from torch import nn

from specter.counting import host_side
from specter.counting import to_device as upload_to
from specter.grouping import ExpertGroups


KERNELS = ("fused", "grouped_mm", "padded")


def pick_kernel(device: torch.device, dtype: torch.dtype,
                capability: tuple[int, int] | None = None, fused: bool | None = None) -> str:
    """The fixed-launch kernel for resident experts of `dtype` on `device` (`capability`: a CUDA
    device's compute capability; read from the device when None). `fused`: whether the fused
    round may be picked (None: where it runs, the CPU's torch body or CUDA's Triton kernel;
    False: the unfused kernels only)."""
    if fused is None:
        from specter.quant.kernels import triton_available

        fused = device.type == "cpu" or (device.type == "cuda" and triton_available())
    if not hasattr(nn.functional, "grouped_mm"):
        return "fused" if fused and device.type == "cuda" else "padded"
    if fused and device.type in ("cpu", "cuda"):
        return "fused"
    if device.type == "cpu":
        return "grouped_mm"
    if device.type == "cuda":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if dtype == torch.bfloat16 and capability[0] in (9, 10):
            return "grouped_mm"
    return "padded"


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host-built int32 indices on `device`, uploaded without a host wait (counting.to_device)."""
    with host_side():
        t = torch.tensor(values, dtype=torch.int32)
    return upload_to(t, device)


class LayerSum:
    """One layer's weighted expert products, each at (its rank among its token's experts,
    its token), then summed rank by rank: the per-token order of an `index_add_` per expert in
    expert-id order. Made once per layer from its routing `groups`: every pair's input row,
    routing weight and place, gathered once, so a round (`grouped_products`) gathers the rows
    of its pairs and places their products with one index each."""

    def __init__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, groups: ExpertGroups,
                 top_k_weights: torch.Tensor, made=None):
        T, k = top_k_index.shape
        self.T, self.k = T, k
        self.rank, self.parts, self.x, self.w, self.at = made or self.make(
            hidden, top_k_index, groups.pos, groups.token, top_k_weights)

    @staticmethod
    def make(hidden, top_k_index, pos, token, top_k_weights):
        """The device tensors of a layer's sum (fixed shapes: what a captured piece can make
        before the routing's host read): (rank, parts, x, w, at)."""
        T, k = top_k_index.shape
        # rank[t, j]: how many of token t's chosen experts have a smaller id than its j-th
        rank = (top_k_index.unsqueeze(1) < top_k_index.unsqueeze(2)).sum(-1)
        parts = torch.zeros(k * T, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        # per pair, in `groups`' order: its input row, its routing weight, where it goes
        return (rank, parts, hidden[token], top_k_weights[token, pos].unsqueeze(-1),
                rank[token, pos] * T + token)

    def place(self, pos: torch.Tensor, token: torch.Tensor, out: torch.Tensor) -> None:
        """Products `out` [n, H] of the pairs (k-slot `pos`, `token`), weighted already."""
        at = self.rank[token, pos] * self.T + token
        self.parts.index_copy_(0, at, out.to(self.parts.dtype))

    def place_pairs(self, pairs: torch.Tensor, y: torch.Tensor) -> None:
        """Unweighted products `y` [n, H] of the pairs at `pairs` (indices into `groups`)."""
        self.parts.index_copy_(0, self.at[pairs], (y * self.w[pairs]).to(self.parts.dtype))

    def result(self) -> torch.Tensor:
        return sum_ranks(self.parts, self.k)


def sum_ranks(parts: torch.Tensor, k: int) -> torch.Tensor:
    """A layer's sum from its `parts` [k T, H]: rank by rank, as `index_add_` into zeros per
    expert in expert-id order adds (fixed shapes: a captured piece can run it)."""
    T = parts.shape[0] // k
    final = torch.zeros_like(parts[:T])  # 0 + x: as index_add_ into zeros
    for r in range(k):
        final = final + parts[r * T:(r + 1) * T]
    return final


def grouped_products(kernel: str, groups: ExpertGroups, slot_of: dict[int, int],
                     buffers: tuple[torch.Tensor, torch.Tensor], act, into: LayerSum) -> None:
    """The experts of `slot_of` (expert -> its slot in `buffers`, the layer's gate_up
    [S, 2I, H] and down [S, H, I] views) over their pairs, weighted, placed `into` the sum, by
    `kernel` (one of KERNELS): one upload, a gather, two GEMM kernels, the gate, the place."""
    if kernel == "fused":
        from specter.quant.kernels import silu_gated

        if silu_gated(act):
            _fused(groups, slot_of, buffers, into)
            return
        kernel = pick_kernel(into.x.device, into.x.dtype, fused=False)
    if kernel == "grouped_mm":
        _grouped_mm(groups, slot_of, buffers, act, into)
    elif kernel == "padded":
        _padded(groups, slot_of, buffers, act, into)
    else:
        raise ValueError(f"unknown grouped kernel {kernel!r}; one of {', '.join(KERNELS)}")


def _slot_order(groups, slot_of, S: int, device):
    """The round's pairs in slot order and each slot's end among them, uploaded at once:
    (pairs, ends [S], the most pairs a slot has)."""
    per_slot = [0] * S
    index: list[int] = []
    for e, s in sorted(slot_of.items(), key=lambda es: es[1]):
        start, n = groups.starts[e], groups.counts[e]
        index.extend(range(start, start + n))
        per_slot[s] = n
    ends, total = [], 0
    for n in per_slot:
        total += n
        ends.append(total)
    both = to_device(index + ends, device)  # one upload: pair indices, then offsets
    return both[:len(index)], both[len(index):], max(per_slot)


def _grouped_mm(groups, slot_of, buffers, act, into: LayerSum) -> None:
    gate_up, down = buffers
    pairs, offs, _ = _slot_order(groups, slot_of, gate_up.shape[0], into.x.device)
    y = nn.functional.grouped_mm(act(nn.functional.grouped_mm(into.x[pairs],
                                                              gate_up.transpose(1, 2), offs=offs)),
                                 down.transpose(1, 2), offs=offs)
    into.place_pairs(pairs, y)


def _fused(groups, slot_of, buffers, into: LayerSum) -> None:
    gate_up, down = buffers
    pairs, ends, most = _slot_order(groups, slot_of, gate_up.shape[0], into.x.device)
    torch.ops.specter.expert_round(into.x, pairs, ends, gate_up, down, into.w, into.at,
                                   into.parts, most, into.x.device.type == "cuda")


# -- a round as one op -----------------------------------------------------------------------
ROUND_BLOCK_M, ROUND_BLOCK_N, ROUND_BLOCK_K = 16, 64, 64


def _round_torch(x, pairs, ends, gate_up, down, w, at, parts) -> None:
    """`grouped_mm`'s round with transformers' SiLU gate: the same operations in the same
    order (bitwise `_grouped_mm` with `_default_apply_gate`)."""
    gate, up = nn.functional.grouped_mm(x[pairs], gate_up.transpose(1, 2),
                                        offs=ends).chunk(2, dim=-1)
    y = nn.functional.grouped_mm(nn.functional.silu(gate) * up, down.transpose(1, 2), offs=ends)
    parts.index_copy_(0, at[pairs], (y * w[pairs]).to(parts.dtype))


def _round_launch(x, pairs, ends, gate_up, down, w, at, parts, most: int) -> None:
    """Two launches of triton_moe.moe_slot_rows: gate_up (gated) into a [pairs, I] buffer,
    then down (weighted, placed) into `parts`."""
    from specter.counting import launched
    from specter.quant.kernels import _kernel, interpret_mode

    S, I2, H = gate_up.shape
    n, I = pairs.shape[0], I2 // 2
    if not (x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
            and parts.stride(1) == 1):
        raise ValueError("expert_round: rows must be contiguous")
    if n == 0:
        return
    h = torch.empty(n, I, dtype=gate_up.dtype, device=x.device)
    kernel = _kernel("moe_slot_rows")
    m = (most + ROUND_BLOCK_M - 1) // ROUND_BLOCK_M
    ieee, upcast = x.dtype == torch.float32, interpret_mode()
    launched("triton")
    kernel[(S, m, (I + ROUND_BLOCK_N - 1) // ROUND_BLOCK_N)](
        x, gate_up, h, pairs, ends, w, at, I, H, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), h.stride(0), FIRST=True, BLOCK_M=ROUND_BLOCK_M,
        BLOCK_N=ROUND_BLOCK_N, BLOCK_K=ROUND_BLOCK_K, IEEE_DOT=ieee, UPCAST=upcast)
    launched("triton")
    kernel[(S, m, (H + ROUND_BLOCK_N - 1) // ROUND_BLOCK_N)](
        h, down, parts, pairs, ends, w, at, H, I, h.stride(0), down.stride(0), down.stride(1),
        parts.stride(0), FIRST=False, BLOCK_M=ROUND_BLOCK_M, BLOCK_N=ROUND_BLOCK_N,
        BLOCK_K=ROUND_BLOCK_K, IEEE_DOT=ieee, UPCAST=upcast)


@torch.library.custom_op("specter::expert_round", mutates_args=("parts",))
def expert_round(x: torch.Tensor, pairs: torch.Tensor, ends: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, w: torch.Tensor, at: torch.Tensor,
                 parts: torch.Tensor, most: int, use_triton: bool) -> None:
    """One verification round of a layer's resident experts (SiLU-gated), from the slot
    buffers gate_up [S, 2I, H] and down [S, H, I]: the round's `pairs` (in slot order, slot s's
    ending at ends[s]; `most`: the most a slot has) read from the pairs' hidden states `x`,
    weighted by `w`, each product written to its row `at` of `parts` (`LayerSum`'s).
    `use_triton`: two launches of the fused kernel (CUDA, or the CPU under
    TRITON_INTERPRET=1); else `grouped_mm`'s arithmetic in torch."""
    if use_triton:
        from specter.quant.kernels import fused_or_torch

        fused_or_torch("expert_round", True,
                       lambda *a: _round_launch(*a, most),
                       _round_torch, x, pairs, ends, gate_up, down, w, at, parts)
    else:
        _round_torch(x, pairs, ends, gate_up, down, w, at, parts)


def _padded(groups, slot_of, buffers, act, into: LayerSum) -> None:
    """Slots lo..hi as one batch of `bmm`s: slot s's pairs in rows [s - lo, :n_s], padded with
    the batch's first pair (computed, then dropped) up to the largest n_s."""
    gate_up, down = buffers
    expert_in = {s: e for e, s in slot_of.items()}
    lo, hi = min(expert_in), max(expert_in)
    width = max(groups.counts[e] for e in slot_of)
    first = groups.starts[expert_in[lo]]
    padded: list[int] = []  # per row of the batch, the pair it computes
    rows: list[int] = []  # the rows kept, in slot order ...
    kept: list[int] = []  # ... and their pairs
    for s in range(lo, hi + 1):
        e = expert_in.get(s)
        n = groups.counts[e] if e is not None else 0
        start = groups.starts[e] if e is not None else first
        padded.extend(range(start, start + n))
        padded.extend([first] * (width - n))
        rows.extend(range((s - lo) * width, (s - lo) * width + n))
        kept.extend(range(start, start + n))
    both = to_device(padded + rows + kept, into.x.device)  # one upload
    n_pad, n_kept = len(padded), len(kept)
    pad_pairs, keep_rows = both[:n_pad], both[n_pad:n_pad + n_kept]
    B = hi - lo + 1
    x = into.x[pad_pairs].view(B, width, -1)
    h = act(torch.bmm(x, gate_up[lo:hi + 1].transpose(1, 2)).flatten(0, 1))  # gate: [rows, 2I]
    y = torch.bmm(h.view(B, width, -1), down[lo:hi + 1].transpose(1, 2)).flatten(0, 1)
    into.place_pairs(both[n_pad + n_kept:], y[keep_rows])
