"""A MoE layer's routing grouped by expert, read from the device once.

Owns: the one host read a layer's routing needs (which experts its tokens chose, and how many
(token, k-slot) pairs each), and every expert's pairs in Hugging Face's order (k-slot, then
token: what `torch.where(top_k_index.T == e)` gives, so sums stay bitwise HF's), from one
stable sort of the whole routing: no search and no host sync per expert.
Does not own: running the experts (offload/runtime.py, quant/kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertGroups:
    needed: list[int]  # experts with at least one pair, ascending
    counts: dict[int, int]  # pairs per needed expert
    starts: dict[int, int]  # where each needed expert's pairs begin in `pos` / `token`
    pos: torch.Tensor  # [T*k] the k-slot of each pair, grouped by expert
    token: torch.Tensor  # [T*k] the token of each pair

    def of(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k-slot positions, token indices) of expert `e`'s pairs: views, no search."""
        s, n = self.starts[e], self.counts[e]
        return self.pos[s:s + n], self.token[s:s + n]


def route_order(top_k_index: torch.Tensor, num_experts: int):
    """The device half of `group_by_expert` (fixed shapes, no host read: what a captured piece
    can hold): (pairs per expert [E], each grouped pair's k-slot [T*k], its token [T*k])."""
    T = top_k_index.shape[0]
    flat = top_k_index.T.reshape(-1)  # pair i = (k-slot i // T, token i % T)
    order = torch.sort(flat, stable=True).indices  # ties keep (k-slot, token) order
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # fixed shape: no sync
    return counts, torch.div(order, T, rounding_mode="floor"), order % T


def read_groups(counts: torch.Tensor, pos: torch.Tensor, token: torch.Tensor) -> ExpertGroups:
    """The host half: the counts read (the layer's one host read), the groups' bounds."""
    per_expert = counts.tolist()  # the layer's one host read
    needed = [e for e, n in enumerate(per_expert) if n]
    starts, s = {}, 0
    for e in needed:
        starts[e] = s
        s += per_expert[e]
    return ExpertGroups(needed, {e: per_expert[e] for e in needed}, starts, pos, token)


def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> ExpertGroups:
    """top_k_index [T, k] -> its pairs grouped by expert; one host read (the counts)."""
    return read_groups(*route_order(top_k_index, num_experts))
