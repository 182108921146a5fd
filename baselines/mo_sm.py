"""`system=mo_sm`: Mixtral-offloading (Eliseev & Mazur, 2023) as docs/paper-notes.md defines it:
autoregressive decoding, an LRU expert cache, plus speculative expert loading: layer l+1's
router applied to layer l's hidden state guesses layer l+1's experts, which are copied while
layer l computes. A wrong guess only costs a transfer; demand misses stay misses, so the
output is the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from specter.decoding.engines import GreedyEngine, build_greedy
from specter.models.introspect import experts_modules, is_experts_module
from specter.offload.prefetch import LayerPrefetcher

ENGINE = GreedyEngine


def router_of(moe_block: nn.Module) -> nn.Module:
    """The router child of an MoE block: neither the experts nor a shared expert."""
    for name, child in moe_block.named_children():
        if not is_experts_module(child) and not name.startswith("shared_expert"):
            return child
    raise RuntimeError(f"{type(moe_block).__name__} has no router child")


class NextLayerRouterPrefetch(LayerPrefetcher):
    """After layer l's demand copies: run router(l+1) on layer l's expert input, load its
    top-k experts for layer l+1 (those not resident), behind the demand copies."""

    def __init__(self, model: nn.Module):
        layers = model.model.layers
        self.routers = [router_of(layers[i].mlp) for i, _ in experts_modules(model)]

    def after_demand(self, runtime, moe_layer: int, hidden: torch.Tensor, top_k_index=None,
                     top_k_weights=None) -> None:
        nxt = moe_layer + 1
        if nxt >= len(self.routers):
            return
        out = self.routers[nxt](hidden)  # (logits, weights, top-k index) on every supported arch
        guess = out[2]  # [T, k]
        runtime.clock.router(hidden.shape[0])
        runtime.prefetch(nxt, sorted(set(guess.flatten().tolist())))  # one read: a host decision


def build(job) -> GreedyEngine:
    return build_greedy(job, "mo_sm", NextLayerRouterPrefetch(job.loaded.model))
