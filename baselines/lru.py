"""`system=lru`: autoregressive greedy decoding with experts offloaded, loaded on demand into
a per-layer LRU cache, no prefetch. `OffloadedGreedyEngine` is shared with MO-SM, which only
adds a prefetcher.
"""

from __future__ import annotations

import torch

from specter.engine import DeviceMemory, Generation, eos_ids, greedy_decode
from specter.offload.build import Timing, offload_model, timing_for
from specter.offload.runtime import OffloadRuntime, Prefetcher


class OffloadedGreedyEngine:
    def __init__(self, name: str, model, device: torch.device, timing: Timing,
                 runtime: OffloadRuntime, stop_on_eos: bool = True):
        self.name, self.model, self.device = name, model, device
        self.timing, self.runtime = timing, runtime
        self.stop = eos_ids(model) if stop_on_eos else set()
        slot_bytes = sum(lc.buf.numel() * lc.buf.element_size() for lc in runtime.cache.layers)
        self.memory = DeviceMemory(model, device, extra_bytes=slot_bytes)
        self.charger = timing.charger(model, charge_experts=False)

    def reset(self) -> None:
        """Fixed initial resident set and LRU order; statistics cleared (outside timing)."""
        self.timing.link.synchronize()
        self.runtime.reset()

    def _before_forward(self, tokens: int, context: int, prefill: bool) -> None:
        self.charger.begin_forward(tokens, context, prefill)
        self.runtime.record_demand = not prefill  # the hit rate excludes prefill

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        gen = greedy_decode(self.model, prompt_ids, max_new_tokens, self.device, self.timing.link,
                            self.stop, self.memory, self._before_forward)
        gen.stats.update(self.runtime.stats.as_record())
        gen.stats.update(self.timing.link_record())
        return gen


def build_offloaded(ctx, name: str, prefetcher: Prefetcher | None = None) -> OffloadedGreedyEngine:
    timing = timing_for(ctx)
    runtime = offload_model(ctx, timing, prefetcher)
    return OffloadedGreedyEngine(name, ctx.loaded.model, ctx.device, timing, runtime,
                                 stop_on_eos=ctx.cfg.workload.stop_on_eos)


def build(ctx) -> OffloadedGreedyEngine:
    return build_offloaded(ctx, "lru")
