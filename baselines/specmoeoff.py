"""`system=specmoeoff`: SpecMoEOff (arXiv 2508.21706) as the Specter artifact re-implements it
at batch 1 (docs/paper-notes.md): speculative decoding with a *separate* INT4 draft model (its own
non-expert weights and its own KV cache), K = 3, and route-frequency prefetch: at draft
fractions 0.2 and 0.6 of each window, the top-M experts per layer by how often the draft has
routed to them so far in the window are loaded for the coming verification.

Shares with lru_s the offload runtime, the LRU cache and the accept rule; differs in the
draft's layout (two instances, two caches) and in the prefetch. Output: the target's tokens.
"""

from __future__ import annotations

import math

import torch

from specter.budget import Footprint
from specter.decoding.draft import SeparateInt4Draft, load_separate_draft_model
from specter.decoding.engines import SpeculativeEngine, build_speculative
from specter.offload.prefetch import WindowPrefetcher
from specter.quant.build import int4_experts_for

ENGINE = SpeculativeEngine
FOOTPRINT = Footprint(int4_draft=True, second_instance=True)  # the INT4 copy, a second instance
K_DEFAULT = 3
OWN_K = (K_DEFAULT, f"SpecMoEOff's K={K_DEFAULT}")  # decoding/depth.py
FRACTIONS = (0.2, 0.6)


class RouteFrequencyPrefetch(WindowPrefetcher):
    """Counts the draft's expert choices per layer within a window; at the given fractions
    of the window loads the top-M most frequent experts of every layer not yet resident.

    The counts live on the device (one `index_add_` per draft layer, no host read), beside
    the first time each expert was counted in the window; they are read once per prefetch
    (a plan boundary), and the top-M ranks by count with ties to the expert counted first,
    as `collections.Counter.most_common` ranks them."""

    def __init__(self, moe_layers: int, runtime, top_m: int, fractions=FRACTIONS):
        self.runtime, self.top_m, self.fractions = runtime, top_m, fractions
        self.moe_layers = moe_layers
        self.num_experts = runtime.cache.store.layout.num_experts
        self.device = runtime.device
        self.prefetched = 0
        self.new_window()

    def on_draft_experts(self, layer: int, top_k_index) -> None:
        flat = top_k_index.flatten()
        self.counts[layer].index_add_(0, flat, torch.ones_like(flat))
        order = torch.arange(self.seen, self.seen + flat.numel(), device=flat.device)
        self.first[layer].scatter_reduce_(0, flat, order, reduce="amin")
        self.seen += flat.numel()

    def new_window(self) -> None:
        shape = (self.moe_layers, self.num_experts)
        self.counts = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.first = torch.full(shape, torch.iinfo(torch.long).max, dtype=torch.long,
                                device=self.device)
        self.seen = 0
        self.fired: set[float] = set()

    def draft_step(self, i: int, k_eff: int) -> None:
        for f in self.fractions:
            if f not in self.fired and i >= max(1, math.ceil(f * k_eff)):
                self.fired.add(f)
                self._prefetch()
        if i == k_eff:
            self.new_window()

    def _prefetch(self) -> None:
        counts, first = torch.stack([self.counts, self.first]).tolist()  # the plan's one read
        for l in range(self.moe_layers):
            ranked = sorted((e for e in range(self.num_experts) if counts[l][e]),
                            key=lambda e: (-counts[l][e], first[l][e]))
            self.prefetched += self.runtime.prefetch(l, ranked[:self.top_m], count=False)

    def reset(self) -> None:
        self.new_window()
        self.prefetched = 0

    def as_record(self) -> dict:
        return {"window_prefetches": self.prefetched, "top_m": self.top_m}


def build(job) -> SpeculativeEngine:
    draft = int4_experts_for(job)
    second = load_separate_draft_model(job)
    return build_speculative(
        job, "specmoeoff",
        lambda timing, _, compiled: SeparateInt4Draft(job.loaded.model, second, draft,
                                                      job.device, timing, compiled=compiled),
        window=lambda runtime, timing, draft: RouteFrequencyPrefetch(
            len(runtime.modules), runtime, job.loaded.spec.top_k), int4=draft)
