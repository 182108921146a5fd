"""The two kinds of prefetch policy and the hooks each one gets.

A `LayerPrefetcher` acts inside one forward: after a MoE layer's demand copies are issued it
sees that layer's expert input and routing, and may load experts for later layers (MO-SM's
next-layer router guess, the quasi-hidden guess). A `WindowPrefetcher` acts across one
speculative window: it sees the draft's routing at every MoE layer of every draft step, is
told after each draft step and when the window ends, and may load experts for the coming
verification (Specter's orchestrator, SpecMoEOff's route-frequency prefetch, the single-plan
and last-window policies). Both load through the runtime's public `prefetch(...)` or the
cache's own `load/pin/stage`, and advance the clock through `runtime.clock (specter/clock/observer.py)`; neither
touches the runtime's private members.

Subclass the base classes below for the no-op defaults. The offload runtime calls a
LayerPrefetcher's hooks; a WindowPrefetcher hears `forward`, `draft_step` and `window_end` as
one of the loop's `Events` observers (decoding/loop.py), and `on_draft_experts` from the
draft's MoE layers.
"""

from __future__ import annotations

import torch


class LayerPrefetcher:
    """Called by the offload runtime after each MoE layer's demand loads are issued."""

    def after_demand(self, runtime, moe_layer: int, hidden: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """`hidden` [T, H] is the layer's expert input, `top_k_index` / `top_k_weights`
        [T, k] its routing."""

    def reset(self) -> None:
        """Before each request (outside timing): clear per-request state and statistics."""

    def as_record(self) -> dict:
        """Record columns of the request just generated."""
        return {}


class WindowPrefetcher:
    """Called by the speculative engine around each draft window."""

    def on_draft_experts(self, layer: int, top_k_index: torch.Tensor) -> None:
        """The draft routed its tokens to `top_k_index` [T, k] at MoE layer `layer`."""

    on_draft_routes = None  # or f(routes [L, T, k]): a compiled step's every layer in one call
    # True where on_draft_routes is device work only, on tensors kept in place (no host read,
    # no new tensor kept): a draft step captured as one CUDA graph then runs it inside the graph
    routes_in_graph = False

    # The loop's events (decoding/loop.py `Events`): the engine lists its window prefetcher.
    def forward(self, phase: str, tokens: int, context: int, rows: int = 1) -> None:
        """A forward is about to run: "prefill" | "draft" | "verify"."""

    def draft_step(self, i: int, k_eff: int) -> None:
        """Draft step `i` (1-based) of `k_eff` in this window is done (i == k_eff: the last)."""

    def window_end(self) -> None:
        """Verification of the window is done and its tokens committed."""

    def reset(self) -> None:
        """Before each request (outside timing)."""

    def as_record(self) -> dict:
        """Record columns of the request just generated."""
        return {}
