"""`system=lru`: autoregressive greedy decoding with experts offloaded, loaded on demand into
a per-layer LRU cache, no prefetch (the eviction policy is `offload.policy`'s)."""

from __future__ import annotations

from specter.decoding.engines import GreedyEngine, build_greedy

ENGINE = GreedyEngine


def build(ctx) -> GreedyEngine:
    return build_greedy(ctx, "lru")
