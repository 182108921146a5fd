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
from collections import Counter


from baselines.lru_s import SpeculativeOffloadEngine, load_separate_draft_model
from specter.offload.build import offload_model, timing_for
from specter.quant.build import draft_for

K_DEFAULT = 3
FRACTIONS = (0.2, 0.6)


class RouteFrequencyPrefetch:
    """Counts the draft's expert choices per layer within a window; at the given fractions
    of the window loads the top-M most frequent experts of every layer not yet resident."""

    def __init__(self, moe_layers: int, runtime, top_m: int, fractions=FRACTIONS):
        self.runtime, self.top_m, self.fractions = runtime, top_m, fractions
        self.moe_layers = moe_layers
        self.counts: list[Counter] = []
        self.prefetched = 0
        self.new_window()

    def count(self, layer: int, top_k_index) -> None:
        """A draft listener: the draft's top-k choices at one MoE layer."""
        self.counts[layer].update(top_k_index.flatten().tolist())  # host sync: routing counts

    def new_window(self) -> None:
        self.counts = [Counter() for _ in range(self.moe_layers)]
        self.fired: set[float] = set()

    def after_draft_step(self, i: int, k_eff: int) -> None:
        for f in self.fractions:
            if f not in self.fired and i >= max(1, math.ceil(f * k_eff)):
                self.fired.add(f)
                self._prefetch()
        if i == k_eff:
            self.new_window()

    def _prefetch(self) -> None:
        cache = self.runtime.cache
        for l, counter in enumerate(self.counts):
            for e, _ in counter.most_common(self.top_m):
                if not cache.resident(l, e) and cache.load(l, e) is not None:
                    self.prefetched += 1


class SpecMoEOffEngine(SpeculativeOffloadEngine):
    def __init__(self, *args, draft_model, top_m: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.attach_separate_draft(draft_model)
        self.prefetch = RouteFrequencyPrefetch(len(self.runtime.modules), self.runtime, top_m)
        self.draft_instance.draft_listeners.append(self.prefetch.count)

    def reset(self) -> None:
        super().reset()
        self.prefetch.new_window()
        self.prefetch.prefetched = 0

    def _decode_options(self) -> dict:
        return {**super()._decode_options(), "after_draft_step": self.prefetch.after_draft_step}

    def _extra_stats(self) -> dict:
        return {"prefetches": self.prefetch.prefetched, "top_m": self.prefetch.top_m}


def build(ctx) -> SpecMoEOffEngine:
    timing = timing_for(ctx)
    draft = draft_for(ctx)
    second = load_separate_draft_model(ctx)
    runtime = offload_model(ctx, timing)
    k = ctx.cfg.spec.k if isinstance(ctx.cfg.spec.k, int) else K_DEFAULT
    engine = SpecMoEOffEngine("specmoeoff", ctx.loaded.model, ctx.device, timing, runtime, draft,
                              k, stop_on_eos=ctx.cfg.workload.stop_on_eos, draft_model=second,
                              top_m=ctx.loaded.spec.top_k)
    engine.temperature = ctx.cfg.workload.temperature
    engine.k_source = "spec.k" if isinstance(ctx.cfg.spec.k, int) else f"SpecMoEOff's K={K_DEFAULT}"
    return engine
