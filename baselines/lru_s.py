"""`system=lru_s`: self-speculative decoding with the INT4 draft, target experts loaded on
demand into the LRU cache at verification, no prefetch (paper-facts.md, "LRU-S").

One model instance: the offloading runtime serves the target's experts, the INT4 copy the
draft's (device-resident, no transfers). Under the virtual clock the draft's experts are
charged at INT4 bytes; attention, shared experts and the lm head are charged by the same
hooks in both modes. Output: the target's greedy tokens (specter/spec/decode.py).
"""

from __future__ import annotations

import torch

from specter.engine import DeviceMemory, Generation, eos_ids
from specter.offload.build import Timing, offload_model, timing_for
from specter.offload.runtime import OffloadRuntime
from specter.quant.build import Draft, draft_for
from specter.quant.shared import SharedInstance
from specter.spec.decode import speculative_greedy

DEFAULT_K = 4


def depth_of(ctx) -> int:
    """spec.k (an integer), else the model's paper K, else DEFAULT_K; `auto` is resolved
    after the engine exists (build_speculative)."""
    k = ctx.cfg.spec.k
    return k if isinstance(k, int) else (ctx.cfg.model.paper_k or DEFAULT_K)


class SpeculativeOffloadEngine:
    """Shared by every system that drafts with the INT4 copy over offloaded target experts;
    they differ in what the runtime prefetches (a `Prefetcher`) and when."""

    def __init__(self, name: str, model, device: torch.device, timing: Timing,
                 runtime: OffloadRuntime, draft: Draft, k: int, stop_on_eos: bool = True):
        self.name, self.model, self.device, self.k = name, model, device, k
        self.timing, self.runtime, self.draft = timing, runtime, draft
        self.shared = SharedInstance(model, draft.experts, draft.backend, device)
        self.stop = eos_ids(model) if stop_on_eos else set()
        slot_bytes = sum(lc.buf.numel() * lc.buf.element_size() for lc in runtime.cache.layers)
        self.memory = DeviceMemory(model, device, extra_bytes=slot_bytes + self.shared.draft_bytes)
        self.charger = timing.charger(model, charge_experts=False)
        if timing.cost is not None and timing.clock == "virtual":
            self.shared.on_draft_experts = self._charge_draft_experts
        self.k_source = "spec.k"

    def _charge_draft_experts(self, top_k_index: torch.Tensor) -> None:
        cost, link = self.timing.cost, self.timing.link
        spec = self.draft.experts.spec
        link.compute(cost.router_s(top_k_index.shape[0]))
        counts = torch.bincount(top_k_index.flatten())
        for n in counts[counts > 0].tolist():  # host sync: charging only
            link.compute(cost.draft_expert_s(n, spec.bits, spec.group))

    def _before_forward(self, tokens: int, context: int, phase: str) -> None:
        self.charger.begin_forward(tokens, context, phase == "prefill")
        self.runtime.record_demand = phase == "verify"  # hit rate: the target's demand

    def reset(self) -> None:
        self.timing.link.synchronize()
        self.runtime.reset()

    def _decode_options(self) -> dict:
        """Extra arguments of `speculative_greedy` (a separate draft, a prefetch hook)."""
        return {}

    def _extra_stats(self) -> dict:
        return {}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        gen = speculative_greedy(self.model, self.shared, prompt_ids, max_new_tokens, self.k,
                                 self.device, self.timing.link, self.stop, self.memory,
                                 self._before_forward, **self._decode_options())
        gen.stats.update(self.runtime.stats.as_record())
        gen.stats.update(self.timing.link_record())
        gen.stats.update(self.draft.as_record())
        gen.stats["k_source"] = self.k_source
        gen.stats.update(self._extra_stats())
        return gen


def build_speculative(ctx, name: str, prefetcher=None) -> SpeculativeOffloadEngine:
    timing = timing_for(ctx)
    draft = draft_for(ctx)  # quantize (or reuse) from the full-precision experts first
    runtime = offload_model(ctx, timing, prefetcher)  # then move the target's experts out
    engine = SpeculativeOffloadEngine(name, ctx.loaded.model, ctx.device, timing, runtime, draft,
                                      depth_of(ctx), stop_on_eos=ctx.cfg.workload.stop_on_eos)
    if ctx.cfg.spec.k is None:
        engine.k_source = "model.paper_k" if ctx.cfg.model.paper_k else f"default {DEFAULT_K}"
    elif ctx.cfg.spec.k == "auto":
        from pathlib import Path

        from specter.models.zoo import default_cache_dir
        from specter.spec.depth import auto_depth

        cache = Path(ctx.cfg.cache_dir) if ctx.cfg.cache_dir else default_cache_dir()
        engine.k, path, reused = auto_depth(ctx, engine, cache)
        engine.k_source = f"auto ({'reused' if reused else 'profiled'}: {path})"
    return engine


def build(ctx) -> SpeculativeOffloadEngine:
    return build_speculative(ctx, "lru_s")
