"""The Expert Lookahead Buffer: per-window counts of the experts the draft routed to.

Owns: an int32 [moe layers x experts] tensor on the device, incremented by every draft MoE
layer's selected experts without a host synchronization (a device-side scatter-add), and the
one device-to-host copy per planning boundary (`snapshot`).
Does not own: what the counts mean for loading (planner.py).
"""

from __future__ import annotations

import torch


class ExpertLookaheadBuffer:
    def __init__(self, moe_layers: int, num_experts: int, device: torch.device):
        self.counts = torch.zeros(moe_layers, num_experts, dtype=torch.int32, device=device)
        self.snapshots = 0  # device-to-host copies taken (one per planning boundary)

    def add(self, layer: int, top_k_index: torch.Tensor) -> None:
        """Count each (token, expert) choice of one draft MoE layer; top_k_index [T, k]."""
        idx = top_k_index.reshape(-1).to(torch.int64)
        self.counts[layer].scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))

    def add_all(self, routes: torch.Tensor) -> None:
        """Every draft MoE layer of one step at once; routes [L, T, k] (one launch)."""
        idx = routes.reshape(routes.shape[0], -1).to(torch.int64)
        self.counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))

    def reset(self) -> None:
        self.counts.zero_()

    def snapshot(self) -> list[list[int]]:
        """The counts on the host: the one synchronization of a planning boundary."""
        self.snapshots += 1
        return self.counts.tolist()  # one read (a GPU's copy and wait), no host tensor between
