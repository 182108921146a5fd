"""A routed expert's arithmetic, the same wherever it runs (device slots, host, a stream).

Owns: one expert's MLP (`expert_mlp`: one GEMM per projection, or one GEMV per token for the
serial ablation), its weighted output over its tokens (`expert_output`), and the layer's sum
in expert-id order (`sum_in_expert_order`, `host_layer_sum`), as Hugging Face's eager loop
sums, so an offloaded layer's output is bitwise the resident layer's.
Does not own: where the weights are (the runtime, offload/host.py, offload/streamed.py).
"""

from __future__ import annotations

import torch
from torch import nn


def expert_output(hidden: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor],
                  top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act,
                  serial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One routed expert over its (k-slot, token) `pairs` (`ExpertGroups.of(e)`, in HF's
    order), weighted: (token_idx [n], out [n, H]). One GEMM per projection over its n tokens,
    or (`serial`, the token-by-token ablation) one GEMV per token. `act` is the gate (SwiGLU
    on the fused gate_up output)."""
    pos, token_idx = pairs
    y = expert_mlp(hidden[token_idx], gate_up, down, act, serial)  # [n, H]
    return token_idx, y * top_k_weights[token_idx, pos, None]


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act,
               serial: bool = False) -> torch.Tensor:
    """One expert's MLP over x [n, H]: one GEMM per projection, or (`serial`) one GEMV per row."""
    def mlp(v):
        return nn.functional.linear(act(nn.functional.linear(v, gate_up)), down)

    if serial:
        return torch.cat([mlp(x[i:i + 1]) for i in range(len(x))]) if len(x) else x
    return mlp(x)


def host_layer_sum(x: torch.Tensor, groups, w: torch.Tensor, views_of, act,
                   serial: bool = False) -> torch.Tensor:
    """A MoE layer's routed experts computed where `x` [T, H] lies (the host): every needed
    expert of `groups` (its (gate_up, down) from `views_of(e)`) over its tokens, weighted by
    `w` [T, k], summed in expert-id order (HF's order: bitwise the resident layer's)."""
    final = torch.zeros_like(x)
    for e in groups.needed:
        token_idx, out = expert_output(x, groups.of(e), w, *views_of(e), act, serial)
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def sum_in_expert_order(hidden: torch.Tensor, outs: dict, experts: list[int]) -> torch.Tensor:
    """The layer's output: each expert's (token_idx, out) added in `experts` order (expert-id
    order, as HF's eager loop sums, so outputs are bitwise those of the resident model)."""
    final = torch.zeros_like(hidden)
    for e in experts:
        token_idx, out = outs[e]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final
