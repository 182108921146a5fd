"""`system=lru_s`: self-speculative decoding with the INT4 draft, target experts loaded on
demand into the LRU cache at verification, no prefetch (docs/paper-notes.md, "LRU-S").

One model instance: the offloading runtime serves the target's experts, the INT4 copy the
draft's (device-resident, no transfers). Under the virtual clock the draft's experts are
charged at INT4 bytes; attention, shared experts and the lm head are charged by the same
hooks in both modes. Output: the target's greedy tokens (specter/spec/decode.py).
"""

from __future__ import annotations

import torch

from specter.engine import DeviceMemory, Generation, cache_bytes, eos_ids
from specter.offload.build import Timing, offload_model, timing_for
from specter.offload.runtime import OffloadRuntime
from specter.quant.build import Draft, draft_for
from specter.quant.shared import SharedInstance
from specter.models.introspect import experts_modules
from specter.models.loading import load_model
from specter.spec.decode import CopiedKVDraft, SeparateDraft, speculative_greedy

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
        slot_bytes = runtime.cache.device_bytes()  # resident slots and staging buffers
        self.memory = DeviceMemory(model, device, extra_bytes=slot_bytes + self.shared.draft_bytes)
        self.charger = timing.charger(model, charge_experts=False)
        if timing.cost is not None and timing.clock == "virtual":
            self.shared.draft_listeners.append(self._charge_draft_experts)
        self.k_source = "spec.k"
        self.temperature = 0.0  # > 0: speculative sampling with `self.generator`
        self.generator: torch.Generator | None = None
        self.separate: SeparateDraft | None = None
        self.draft_instance = self.shared  # the instance whose draft routing listeners see
        self._draft_charger = None
        self.kv_copy_bytes = self.kv_copies = 0  # copies to a CopiedKVDraft this request

    def attach_separate_draft(self, draft_model, kv_copy: bool = False) -> None:
        """Draft with a second instance (its own non-expert weights, routed experts = the INT4
        copy only) instead of the shared instance's draft mode: SpecMoEOff's layout (its own KV
        cache, catching up on the tokens it has not seen), and Specter's no-sharing ablation
        (`kv_copy`: the target's committed KV copied to it at every window's start, the
        artifact's "SIC off"; else SpecMoEOff's own KV)."""
        self.separate = CopiedKVDraft(draft_model, self._charge_kv_copy) if kv_copy \
            else SeparateDraft(draft_model)
        self.draft_instance = SharedInstance(draft_model, self.draft.experts, self.draft.backend,
                                             self.device)
        self.draft_instance.mode = "draft"  # this instance is only ever the draft
        self._draft_charger = self.timing.charger(draft_model, charge_experts=False)
        if self.timing.cost is not None and self.timing.clock == "virtual":
            self.draft_instance.draft_listeners.append(self._charge_draft_experts)
        # The second instance's non-expert weights.
        self.memory.param_bytes += sum(p.numel() * p.element_size() for p in draft_model.parameters())

    def _charge_draft_experts(self, layer: int, top_k_index: torch.Tensor) -> None:
        cost, link = self.timing.cost, self.timing.link
        spec = self.draft.experts.spec
        link.compute(cost.router_s(top_k_index.shape[0]))
        counts = torch.bincount(top_k_index.flatten())
        per_expert = counts[counts > 0].tolist()  # host sync: charging only
        link.compute(cost.draft_experts_s(per_expert, spec.bits, spec.group))  # one fused kernel

    def _charge_kv_copy(self, tokens: int, cache) -> None:
        """One per-window copy of the committed KV (`tokens` positions), device to device: on
        the virtual clock the charged sizes' KV bytes (the real model's under charge=real) read
        and written at the device's memory bandwidth, plus one copy kernel per layer's K and V;
        real clocks measure the copy itself."""
        cost = self.timing.cost
        if cost is not None and self.timing.clock == "virtual":
            s = cost.sizes
            layers = len(self.model.model.layers) * s.attn_multiplier
            nbytes = int(round(tokens * s.kv_elems_per_token * s.elem_bytes * layers))
            self.timing.link.compute(2 * nbytes / cost.hw.mem_bandwidth_Bps
                                     + 2 * layers * cost.hw.launch_overhead_s)
        else:
            nbytes = cache_bytes(cache)
        self.kv_copy_bytes += nbytes
        self.kv_copies += 1

    def _before_forward(self, tokens: int, context: int, phase: str) -> None:
        self.charger.begin_forward(tokens, context, phase == "prefill")
        if self._draft_charger is not None:
            self._draft_charger.begin_forward(tokens, context, phase == "prefill")
        self.runtime.record_demand = phase == "verify"  # hit rate: the target's demand

    def reset(self) -> None:
        self.timing.link.synchronize()
        self.runtime.reset()
        self.kv_copy_bytes = self.kv_copies = 0

    def seed_request(self, seed: int) -> None:
        """The sampling generator of the next request (workload.temperature > 0)."""
        self.generator = torch.Generator().manual_seed(seed)

    def _decode_options(self) -> dict:
        """Extra arguments of `speculative_greedy` (a separate draft, a prefetch hook)."""
        return {"separate": self.separate} if self.separate is not None else {}

    def _extra_stats(self) -> dict:
        return {}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        sampling = {"temperature": self.temperature, "generator": self.generator} \
            if self.temperature > 0 else {}
        gen = speculative_greedy(self.model, self.shared, prompt_ids, max_new_tokens, self.k,
                                 self.device, self.timing.link, self.stop, self.memory,
                                 self._before_forward, **sampling, **self._decode_options())
        gen.stats.update(self.runtime.stats.as_record())
        gen.stats.update(self.timing.link_record())
        gen.stats.update(self.draft.as_record())
        gen.stats["k_source"] = self.k_source
        gen.stats["staged_loads"] = self.runtime.cache.staged_loads  # prefetches into staging
        gen.stats.update(self._extra_stats())
        return gen


def load_separate_draft_model(ctx):
    """The same checkpoint loaded a second time as a stand-alone draft: its routed experts
    will be the INT4 copy only (its full-precision expert tensors are dropped)."""
    from pathlib import Path

    cache_dir = Path(ctx.cfg.cache_dir) if ctx.cfg.cache_dir else None
    second = load_model(ctx.cfg.model, ctx.device, cache_dir, ctx.cfg.model_seed,
                        progress=False).model
    for _, m in experts_modules(second):
        m.gate_up_proj = torch.nn.Parameter(torch.empty(0, device=ctx.device), requires_grad=False)
        m.down_proj = torch.nn.Parameter(torch.empty(0, device=ctx.device), requires_grad=False)
        m._specter_moe_layer = -1  # still an experts module for introspection
    return second


def build_speculative(ctx, name: str, prefetcher=None, engine_cls=None, separate: bool = False,
                      **engine_kwargs) -> SpeculativeOffloadEngine:
    """Quantize (or reuse) the draft from the full-precision experts, load a separate draft
    model if asked, offload the target's experts, build `engine_cls` and settle its K."""
    timing = timing_for(ctx)
    draft = draft_for(ctx)  # from the full-precision experts, before they move out
    if separate:
        engine_kwargs["draft_model"] = load_separate_draft_model(ctx)
    runtime = offload_model(ctx, timing, prefetcher)
    engine = (engine_cls or SpeculativeOffloadEngine)(
        name, ctx.loaded.model, ctx.device, timing, runtime, draft, depth_of(ctx),
        stop_on_eos=ctx.cfg.workload.stop_on_eos, **engine_kwargs)
    engine.temperature = ctx.cfg.workload.temperature
    resolve_depth(ctx, engine)
    return engine


def resolve_depth(ctx, engine: SpeculativeOffloadEngine) -> None:
    """spec.k=N: N; unset: the model's paper K (or DEFAULT_K); auto: profiled on this very
    engine (specter/spec/depth.py), stored and reused."""
    if ctx.cfg.spec.k is None:
        engine.k_source = "model.paper_k" if ctx.cfg.model.paper_k else f"default {DEFAULT_K}"
    elif ctx.cfg.spec.k == "auto":
        from pathlib import Path

        from specter.models.zoo import default_cache_dir
        from specter.spec.depth import auto_depth

        cache = Path(ctx.cfg.cache_dir) if ctx.cfg.cache_dir else default_cache_dir()
        engine.k, path, reused = auto_depth(ctx, engine, cache)
        engine.k_source = f"auto ({'reused' if reused else 'profiled'}: {path})"


def build(ctx) -> SpeculativeOffloadEngine:
    return build_speculative(ctx, "lru_s")
