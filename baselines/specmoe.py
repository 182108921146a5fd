"""`system=specmoe`: SpecMoE (arXiv 2604.10152, seed 003) as we read it at batch 1.

This is a reading, not the authors' code (docs/paper-notes.md, Baselines: "self-assisted
speculative decoding, draft computed where the experts live (host), verification on the GPU
with prefetched experts"); the digest gives no draft-width or gamma figures, so those below
are ours:

- No extra model and no quantized copy: the draft is the target model itself (the same
  attention, norms, routers, shared experts and the same KV cache, lru_s's shared instance),
  whose *routed* experts run on the host CPU from the full-precision host copy (where the
  experts live: no expert crosses the link for the draft).
- The cheapener is the model's own sparsity: each draft token computes only the
  `draft_top_k` routed experts of largest routing weight among the router's top-k (default
  `max(1, top_k // 2)`): the model run as its own router would run it at top-`draft_top_k`.
  So the kept weights are rescaled to the original top-k sum only where the router itself
  normalizes its top-k (Mixtral; `norm_topk_prob=True`); elsewhere (DeepSeek-V2, Qwen1.5-MoE,
  OLMoE: raw softmax probabilities; Phi-3.5-MoE: sparsemixer multipliers near 1 each) the
  dropped experts' weight is simply dropped: rescaling a small kept share of a non-normalized
  router amplifies one expert several-fold, and the acceptance measured both ways agrees with
  the rule on every model but one (docs/measurements/specmoe-draft-renormalization.md). With
  `draft_top_k == top_k` the draft is exactly the target computed elsewhere.
- Draft depth K: `spec.k` if an integer, else 4 (`K_DEFAULT`; model.paper_k is Specter's
  depth, not SpecMoE's): a small gamma, since every draft token is serial host work
  (draft_top_k full-precision expert reads per MoE layer at host memory bandwidth) that a
  rejected proposal wastes; 4 is also the repository's default speculation depth.
- Prefetch: at every draft MoE layer, as soon as the draft's router has chosen, each expert
  of its *full* top-k (ranked by weight; the router's choice is the best guess of what the
  target will need, and the target computes all top-k) that is new in this window is loaded
  for the target if not resident (`cache.load`, one prefetch per new expert) and held (also
  if already resident) so later prefetches of the window do not evict it; holding stops
  once the layer's held set fills its slots. The copies overlap the host's draft work.
  The runtime releases a layer's holds when verification reaches it; all holds are released
  again between windows.
- Verification on the device: the offload runtime with the LRU cache, misses loaded on
  demand. Greedy acceptance (`speculative_greedy`) keeps the output the target's exactly.

Virtual clock per draft MoE layer: the router (`cost.router_s`), `cost.host_expert_s(n)` per
distinct kept expert (n its tokens), and the hidden state's round trip to the host, charged
on the compute stream as two link latencies plus `T * H * elem` bytes each way (the host's
result is waited for; its contention with the prefetch copies on the link is ignored).
Attention, shared experts and the lm head are charged by the engine's clock (clock/observer.py) in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specter.config import SystemConfig
from specter.counting import charging_only
from specter.decoding.draft import Draft
from specter.decoding.engines import SpeculativeEngine, build_speculative
from specter.decoding.draft_mode import DraftMode
from specter.errors import UserError
from specter.grouping import group_by_expert
from specter.clock.timing import Timing
from specter.offload.prefetch import WindowPrefetcher
from specter.offload.mlp import host_layer_sum
from specter.offload.runtime import OffloadRuntime

ENGINE = SpeculativeEngine
K_DEFAULT = 4
OWN_K = (K_DEFAULT, f"SpecMoE reading's K={K_DEFAULT}")  # decoding/depth.py


@dataclass
class Config(SystemConfig):
    draft_top_k: int | None = None  # experts per draft token; None: max(1, top_k // 2)

    def validate(self) -> None:
        if self.draft_top_k is not None and self.draft_top_k < 1:
            raise UserError(f"system.draft_top_k must be at least 1 (got {self.draft_top_k}).")


def default_draft_top_k(top_k: int) -> int:
    return max(1, top_k // 2)


def router_normalizes(config) -> bool:
    """Whether the model's router rescales its top-k weights to sum to one (then so does the
    draft's narrower top-k)."""
    return config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))


def truncate_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, keep: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The `keep` routed experts of largest weight per token ([T, k] -> [T, keep]); with
    `renormalize`, the kept weights rescaled to the original top-k sum. (Routers do not all
    sort their top-k: DeepSeek-V2's is `sorted=False`.)"""
    k = top_k_index.shape[-1]
    if keep >= k:
        return top_k_index, top_k_weights
    w, pos = torch.topk(top_k_weights, keep, dim=-1)
    idx = torch.gather(top_k_index, -1, pos)
    if renormalize:
        total, kept = top_k_weights.sum(-1, keepdim=True), w.sum(-1, keepdim=True)
        w = w * (total / kept.clamp_min(torch.finfo(w.dtype).tiny))
    return idx, w


def ranked_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> list[int]:
    """Distinct experts of the router's choice, largest weight first (over all tokens)."""
    order = torch.argsort(top_k_weights.flatten(), descending=True, stable=True)
    seen: dict[int, None] = {}
    for e in top_k_index.flatten()[order].tolist():  # host sync: a host decision
        seen.setdefault(e, None)
    return list(seen)


class HostDraftExperts:
    """The draft's routed experts of one MoE layer, computed on the host from the store's
    full-precision copy with the truncated routing; a `DraftMode` draft layer."""

    def __init__(self, owner: "HostDraft", layer: int, module: nn.Module):
        self.owner, self.layer, self.module = owner, layer, module

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        o = self.owner
        idx, w = truncate_routing(top_k_index, top_k_weights, o.draft_top_k, o.renormalize)
        for listener in o.listeners:  # prefetch first (copies overlap the host work) ...
            listener(self.layer, top_k_index, top_k_weights, idx)
        if o.charge is not None:  # ... then the clock's charge for the host work
            o.charge(self.layer, top_k_index, top_k_weights, idx)
        host = o.host
        x, idx_h, w_h = hidden.to(host), idx.to(host), w.to(host)  # the activation goes over
        store, layout = o.runtime.cache.store, o.runtime.cache.layout
        final = host_layer_sum(x, group_by_expert(idx_h, layout.num_experts), w_h,
                               lambda e: layout.views(store.expert(self.layer, e)),
                               self.module._apply_gate)  # host [2I, H], [H, I] views
        return final.to(hidden.device)  # ... and comes back


class HostDraft(Draft):
    """The draft part: the target's own instance in draft mode, every MoE layer's routed
    experts computed on the host (no quantized copy, no device bytes)."""

    def __init__(self, model, runtime: OffloadRuntime, timing: Timing, draft_top_k: int,
                 renormalize: bool):
        self.runtime, self.timing = runtime, timing
        self.draft_top_k, self.renormalize = draft_top_k, renormalize
        self.host = torch.device("cpu")
        self.backend = "host"
        # Told of each draft layer call: (moe_layer, router top_k_index [T, k], its weights,
        # kept index [T, draft_top_k]); `charge` after them.
        self.listeners: list = []
        self.clock = timing.observer(None, False)  # prices the host work (virtual clock)
        self.charge = self._charge_host_experts if timing.charged else None
        self.layers = [HostDraftExperts(self, l, m) for l, m in enumerate(runtime.modules)]
        self.draft_mode = DraftMode(model, None, draft_layers=self.layers, draft_bytes=0)

    def _charge_host_experts(self, layer: int, top_k_index, top_k_weights, kept_index) -> None:
        with charging_only():
            counts = torch.bincount(kept_index.flatten())
            per_expert = counts[counts > 0].tolist()  # host sync: charging only
        self.clock.host_experts(kept_index.shape[0], per_expert, self.runtime.cache.layout.hidden)

    def as_record(self) -> dict:
        return {"draft.method": "host_topk",
                "draft.bits": torch.finfo(self.runtime.cache.layout.dtype).bits,
                "draft.top_k": self.draft_top_k,
                "draft.renormalize": self.renormalize, "draft.backend": self.backend,
                "draft.bytes": 0, "draft_top_k": self.draft_top_k, "shared_instance": True,
                "draft_kv": "shared", "kv_copy_bytes": 0, "kv_copies": 0}


class WindowPrefetch(WindowPrefetcher):
    """Loads and holds, per layer, every expert the draft's router picks that is new in the
    window; holds stop at the layer's slot count. Told by the host draft (it ranks by the
    router's weights, which `on_draft_experts` does not carry)."""

    def __init__(self, runtime: OffloadRuntime):
        self.runtime = runtime
        self.prefetched = 0
        self.seen: list[set[int]] = []
        self.new_window()

    def new_window(self) -> None:
        self.runtime.cache.release_all_holds()
        self.seen = [set() for _ in self.runtime.modules]

    def __call__(self, layer: int, top_k_index, top_k_weights, kept_index) -> None:
        cache, seen = self.runtime.cache, self.seen[layer]
        for e in ranked_routing(top_k_index, top_k_weights):
            if e in seen:
                continue
            seen.add(e)
            if len(cache.layers[layer].held) >= cache.slots:
                continue  # the layer's slots are all planned: no load could land
            if not cache.resident(layer, e):
                if cache.load(layer, e) is None:
                    continue
                self.prefetched += 1
            cache.hold(layer, [e])

    def window_end(self) -> None:
        self.new_window()

    def reset(self) -> None:
        self.new_window()
        self.prefetched = 0

    def as_record(self) -> dict:
        return {"window_prefetches": self.prefetched}


def build(job, draft_top_k: int | None = None, renormalize: bool | None = None) -> SpeculativeEngine:
    """`draft_top_k`: argument, else `system.draft_top_k` if set, else
    `max(1, top_k // 2)`; `renormalize`: argument, else as the model's router does."""
    top_k = job.loaded.spec.top_k
    if draft_top_k is None:
        draft_top_k = job.system.draft_top_k or default_draft_top_k(top_k)
    if not 1 <= draft_top_k <= top_k:
        raise UserError(f"system.draft_top_k must be between 1 and the model's top-k ({top_k}); "
                        f"got {draft_top_k}.")
    renormalize = router_normalizes(job.loaded.model.config) if renormalize is None \
        else renormalize

    def make_window(runtime, timing, draft: HostDraft) -> WindowPrefetch:
        prefetch = WindowPrefetch(runtime)
        draft.listeners.append(prefetch)  # told with the router's weights, before the charge
        return prefetch

    return build_speculative(  # the host store is also the draft's expert weights
        job, "specmoe",
        lambda timing, runtime, _: HostDraft(job.loaded.model, runtime, timing, draft_top_k,
                                             renormalize),
        window=make_window)
