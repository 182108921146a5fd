"""A MoE layer's routed experts computed as grouped GEMMs over the device slots, summed per
token in expert-id order.

Owns: the arithmetic of a batch of resident experts in a few fixed launches, however many
experts and tokens it covers: their (token, k-slot) pairs put in slot order (one upload of
host-built indices; the routing is already on the host, `specter/grouping.py`), one grouped
GEMM per projection over the layer's whole slot buffer (`torch.nn.functional.grouped_mm`,
empty groups cost nothing), the routing weights, and each product placed at its token's rank
(`LayerSum`); the layer's sum is then k additions in expert-id order, the order Hugging Face's
eager loop adds in (its `index_add_` per expert), so the products and their sums are those of
the per-expert loop (tests/test_grouped.py holds them bitwise on the CPU).
Does not own: which experts are resident or when a batch is computed (offload/runtime.py).

Where grouped GEMMs are offered: the CPU (torch >= 2.9), and CUDA devices of compute
capability 8.0 or more in bfloat16 (torch's documented inputs); elsewhere the runtime keeps
its loop of one GEMM per expert and projection (`grouped_available`). A CUDA run's default
dtype is float16 (`model.dtype=auto`), so there it is the loop unless `model.dtype=bfloat16`;
`scripts/gpu_check.sh`'s hotpath stage probes which dtypes the device's grouped GEMM takes.
"""

from __future__ import annotations

import torch
from torch import nn

from specter.counting import host_side, upload
from specter.grouping import ExpertGroups


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `grouped_mm` runs for weights of `dtype` on `device` in this torch."""
    if not hasattr(nn.functional, "grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host-built int32 indices on `device`: from pinned memory without blocking on a GPU (the
    stream does not wait for the host), counted as the copy it is (a launch, no sync)."""
    with host_side():
        t = torch.tensor(values, dtype=torch.int32)
        if device.type != "cpu":
            t = t.pin_memory()
    if device.type == "cpu":
        upload(blocking=False)
        return t
    return t.to(device, non_blocking=True)


class LayerSum:
    """One layer's weighted expert products, each at (its rank among its token's experts,
    its token), then summed rank by rank: the per-token order of an `index_add_` per expert in
    expert-id order."""

    def __init__(self, hidden: torch.Tensor, top_k_index: torch.Tensor):
        T, k = top_k_index.shape
        self.T, self.k = T, k
        # rank[t, j]: how many of token t's chosen experts have a smaller id than its j-th
        self.rank = (top_k_index.unsqueeze(1) < top_k_index.unsqueeze(2)).sum(-1)
        self.parts = torch.zeros(k * T, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)

    def place(self, pos: torch.Tensor, token: torch.Tensor, out: torch.Tensor) -> None:
        """Products `out` [n, H] of the pairs (k-slot `pos`, `token`)."""
        at = self.rank[token, pos] * self.T + token
        self.parts.index_copy_(0, at, out.to(self.parts.dtype))

    def result(self) -> torch.Tensor:
        T, parts = self.T, self.parts
        final = torch.zeros_like(parts[:T])  # 0 + x: as index_add_ into zeros
        for r in range(self.k):
            final = final + parts[r * T:(r + 1) * T]
        return final


def grouped_products(hidden: torch.Tensor, groups: ExpertGroups, top_k_weights: torch.Tensor,
                     slot_of: dict[int, int], buffers: tuple[torch.Tensor, torch.Tensor], act,
                     into: LayerSum) -> None:
    """The experts of `slot_of` (expert -> its slot in `buffers`, the layer's gate_up
    [S, 2I, H] and down [S, H, I] views) over their pairs, weighted, placed `into` the sum."""
    gate_up, down = buffers
    S = gate_up.shape[0]
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
    both = to_device(index + ends, hidden.device)  # one upload: pair indices, then offsets
    pairs, offs = both[:len(index)], both[len(index):]
    pos, token = groups.pos[pairs], groups.token[pairs]
    x = hidden[token]
    y = nn.functional.grouped_mm(act(nn.functional.grouped_mm(x, gate_up.transpose(1, 2),
                                                              offs=offs)),
                                 down.transpose(1, 2), offs=offs)
    into.place(pos, token, y * top_k_weights[token, pos, None])
