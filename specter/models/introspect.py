"""What every supported MoE looks like from the outside, found by inspection, not by name.

Owns: finding the routed-experts modules of any transformers MoE (modules holding fused 3D
`gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` parameters), the per-model MoE facts the
rest of the system needs (`MoESpec`), observing the router's top-k choices with a pre-hook
on the experts call (so no router is re-implemented), one expert's layout (`ExpertLayout`)
and its full-precision weights wherever they live (`expert_weights`: the fused parameters, or
the host store offload/store.py fills).
Does not own: changing how experts run (that is the offloading runtime's experts
implementation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    arch: str  # HF model_type
    num_layers: int  # all decoder layers
    moe_layers: tuple[int, ...]  # decoder-layer index of each MoE layer, in order
    num_experts: int
    top_k: int
    hidden: int
    expert_inter: int
    shared_experts: bool
    expert_bytes: int  # one routed expert (gate, up, down) at the model's dtype
    non_expert_bytes: int  # every parameter that is not a routed expert
    kv_bytes_per_token: int  # KV cache bytes one token adds across all layers
    outside_layer_bytes: int = 0  # parameters in no decoder layer (embeddings, final norm, head)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def slot_bytes(self, slots: int) -> int:
        """Device bytes for `slots` resident experts in every MoE layer."""
        return slots * self.num_moe_layers * self.expert_bytes


def is_experts_module(m: nn.Module) -> bool:
    """Fused routed experts (3D gate_up_proj / down_proj), or ones whose weights the offload
    runtime moved to host memory (it tags them with their MoE layer)."""
    if hasattr(m, "_specter_moe_layer"):
        return True
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3


def experts_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder-layer index, experts module) for every MoE layer, in layer order."""
    found = []
    for i, layer in enumerate(_decoder_layers(model)):
        mods = [m for m in layer.modules() if is_experts_module(m)]
        if len(mods) > 1:
            raise RuntimeError(f"layer {i} has {len(mods)} routed-experts modules; expected one")
        if mods:
            found.append((i, mods[0]))
    return found


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer, in layer order: the sibling of the experts module that
    holds a 2D `weight` of shape [experts, hidden] (HF names it `gate` or `router`). Every
    supported router returns (logits [T, E], weights [T, k], indices [T, k])."""
    found = []
    for i, experts in experts_modules(model):
        layer = _decoder_layers(model)[i]
        parent = next(m for m in layer.modules() if any(c is experts for c in m.children()))
        n_exp = experts.gate_up_proj.shape[0]
        cands = [c for c in parent.children()
                 if isinstance(getattr(c, "weight", None), torch.Tensor)
                 and c.weight.dim() == 2 and c.weight.shape[0] == n_exp]
        if len(cands) != 1:
            raise RuntimeError(f"layer {i}: found {len(cands)} router candidates beside the "
                               f"experts (a module with a [{n_exp}, hidden] weight); expected one")
        found.append(cands[0])
    return found


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RuntimeError(f"{type(model).__name__}: cannot find decoder layers at .model.layers")
    return layers


def _kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token adds to an uncompressed HF cache, summed over layers."""
    elem = torch.finfo(dtype).bits // 8
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) is not None:  # DeepSeek MLA: HF caches full K, V
        k_dim = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
        v_dim = heads * config.v_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        k_dim = v_dim = heads * head_dim
    return (k_dim + v_dim) * elem * config.num_hidden_layers


def moe_spec(model: nn.Module) -> MoESpec:
    cfg = model.config
    mods = experts_modules(model)
    if not mods:
        raise RuntimeError(f"{type(model).__name__} has no routed-experts modules")
    _, first = mods[0]
    e, two_i, h = first.gate_up_proj.shape
    per_expert = (first.gate_up_proj[0].numel() + first.down_proj[0].numel()) * first.gate_up_proj.element_size()
    expert_ids = {id(p) for _, m in mods for p in (m.gate_up_proj, m.down_proj)}
    non_expert = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_ids)
    shared = any(("shared_expert" in n) for n, _ in model.named_modules())
    in_layers = {id(p) for p in _decoder_layers(model).parameters()}
    outside = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers)
    return MoESpec(
        arch=cfg.model_type, num_layers=cfg.num_hidden_layers, moe_layers=tuple(i for i, _ in mods),
        num_experts=e, top_k=cfg.num_experts_per_tok, hidden=h, expert_inter=two_i // 2,
        shared_experts=shared, expert_bytes=per_expert, non_expert_bytes=non_expert,
        kv_bytes_per_token=_kv_bytes_per_token(cfg, first.gate_up_proj.dtype),
        outside_layer_bytes=outside,
    )


@torch.no_grad()
def router_topk(model: nn.Module, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Top-k expert ids chosen by each MoE layer's router for `input_ids`: one
    [tokens, k] tensor per MoE layer, observed at the experts call."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].detach().clone()))
             for _, m in experts_modules(model)]
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def forward_logits(model, ids: torch.Tensor, cache, logits_to_keep: int = 1) -> torch.Tensor:
    """One forward over `ids` [1, T] appending to `cache`; returns logits [T', V] for the last
    `logits_to_keep` positions."""
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0]


STORE_ATTR = "_specter_host_store"  # the model's HostExpertStore, once its experts are in one


@dataclass(frozen=True)
class ExpertLayout:
    num_experts: int
    inter: int  # I
    hidden: int  # H
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 3 * self.inter * self.hidden  # gate_up [2I, H] + down [H, I]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.finfo(self.dtype).bits // 8

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) views of one flat expert buffer."""
        split = 2 * self.inter * self.hidden
        return (flat[:split].view(2 * self.inter, self.hidden),
                flat[split:].view(self.hidden, self.inter))

    def stacked_views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [S, 2I, H], down [S, H, I]) views of S flat expert buffers [S, numel]."""
        split, S = 2 * self.inter * self.hidden, flat.shape[0]
        return (flat[:, :split].view(S, 2 * self.inter, self.hidden),
                flat[:, split:].view(S, self.hidden, self.inter))

    @classmethod
    def of(cls, module: nn.Module, dtype: torch.dtype | None = None) -> "ExpertLayout":
        """The layout of an experts module's fused parameters (their shapes: real or meta)."""
        e, two_i, h = module.gate_up_proj.shape
        return cls(num_experts=e, inter=two_i // 2, hidden=h,
                   dtype=dtype or module.gate_up_proj.dtype)


def host_store(model: nn.Module) -> "HostExpertStore | None":
    """The store holding the model's routed experts (offload/store.py `HostExpertStore`), or
    None while they are its parameters."""
    return getattr(model, STORE_ATTR, None)


def expert_weights(model: nn.Module, moe_layer: int, expert: int,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) of one routed expert at full precision: views of the
    model's fused parameters, or of its host store's buffer (copied to `device` when given:
    a GPU reading an expert that lives in host memory)."""
    store = host_store(model)
    if store is not None:
        return store.weights(moe_layer, expert, device)
    _, mod = experts_modules(model)[moe_layer]
    gate_up, down = mod.gate_up_proj[expert].detach(), mod.down_proj[expert].detach()
    if device is not None:
        gate_up, down = gate_up.to(device), down.to(device)
    return gate_up, down


def expert_layout(model: nn.Module) -> ExpertLayout:
    """The routed experts' layout, wherever they live."""
    store = host_store(model)
    return store.layout if store is not None else ExpertLayout.of(experts_modules(model)[0][1])
