"""Host-side expert store: every routed expert of every MoE layer as one flat buffer.

Owns: the one host copy of the routed experts, each expert one contiguous buffer (so a copy
is one async DMA) inside one of a few large allocations, pinned on CUDA, laid out by
offload/pinned.py's plan (power-of-two chunks, which torch's pinned allocator does not round
up further); filled either from a loaded model's fused 3D parameters (`from_model`, freeing
each layer's fused copy as it goes) or tensor by tensor from the checkpoint's safetensors
files (placement/loader.py, so the experts never pass through the device); viewing a flat
buffer, host or device, as that expert's (gate_up [2I, H], down [H, I]: models/introspect.py
`ExpertLayout`, where `expert_weights` reads one expert wherever it lives).
Does not own: the device slots or what is resident (cache.py), timing (link.py), the
chunk plan and what the allocator reserves for it (pinned.py).
"""

from __future__ import annotations

import torch
from torch import nn

from specter.models.introspect import (  # (re-exported: read wherever the experts live)
    STORE_ATTR, ExpertLayout, expert_layout, expert_weights, experts_modules, host_store)
from specter.offload.pinned import StorePlan, store_plan

__all__ = ["STORE_ATTR", "ExpertLayout", "HostExpertStore", "expert_layout", "expert_weights",
           "host_store", "release_fused"]


class HostExpertStore:
    """flat[l][e]: the host copy of expert e of MoE layer l (l counts MoE layers only), a
    contiguous view into one of `chunks` (the allocations `plan` lays out); `layers[l]`: that
    MoE layer's decoder-layer index. Made empty (`__init__`), then filled."""

    def __init__(self, layers: list[int], layout: ExpertLayout, pin: bool):
        self.layers, self.layout, self.pin = list(layers), layout, pin
        self.checksum: str | None = None  # the draft's source checksum, once computed
        self.plan: StorePlan = store_plan(layout, len(self.layers))
        elem = layout.nbytes // layout.numel
        self.chunks: list[torch.Tensor] = [
            torch.empty(c.nbytes // elem, dtype=layout.dtype, pin_memory=pin)
            for c in self.plan.chunks]
        places = self.plan.places()
        self.flat: list[list[torch.Tensor]] = [
            [self._slot(*next(places), elem) for _ in range(layout.num_experts)]
            for _ in self.layers]

    def _slot(self, chunk: int, offset: int, elem: int) -> torch.Tensor:
        start = offset // elem
        return self.chunks[chunk][start:start + self.layout.numel]

    @property
    def reserved_bytes(self) -> int:
        """The host memory its allocations take (pinned: as torch's pinned allocator
        reserves them)."""
        return self.plan.reserved_bytes(self.pin)

    @classmethod
    def from_model(cls, model: nn.Module, pin: bool) -> "HostExpertStore":
        """The store of a model loaded with its experts in fused parameters: each layer is
        copied in and its fused copies freed at once, so the process holds one copy of the
        experts plus at most one layer while converting."""
        mods = experts_modules(model)
        layouts = {ExpertLayout.of(m) for _, m in mods}
        assert len(layouts) == 1, "all MoE layers must share one expert layout"
        store = cls([i for i, _ in mods], layouts.pop(), pin)
        for l, (_, mod) in enumerate(mods):
            gate_up, down = mod.gate_up_proj.detach(), mod.down_proj.detach()
            for e, flat in enumerate(store.flat[l]):
                g, d = store.layout.views(flat)
                g.copy_(gate_up[e])
                d.copy_(down[e])
            del gate_up, down
            release_fused(mod, l)
        setattr(model, STORE_ATTR, store)
        return store

    def adopt(self, model: nn.Module) -> None:
        """Take over a model whose experts modules hold meta tensors of the fused shapes (a
        model loaded with its experts straight into this store): tag each with its MoE layer
        and leave it empty, as `from_model` leaves a model it copied."""
        for l, (_, mod) in enumerate(experts_modules(model)):
            release_fused(mod, l)

    @property
    def num_moe_layers(self) -> int:
        return len(self.flat)

    def expert(self, moe_layer: int, expert: int) -> torch.Tensor:
        return self.flat[moe_layer][expert]

    def weights(self, moe_layer: int, expert: int,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert: views of its host buffer, or copies on
        `device` when that is elsewhere."""
        gate_up, down = self.layout.views(self.flat[moe_layer][expert])
        if device is not None and gate_up.device != torch.device(device):
            gate_up, down = gate_up.to(device), down.to(device)
        return gate_up, down


def release_fused(mod: nn.Module, moe_layer: int) -> None:
    """Empty an experts module's fused parameters; it stays an experts module by its tag."""
    mod._specter_moe_layer = moe_layer
    for name in ("gate_up_proj", "down_proj"):
        old = getattr(mod, name)
        device = old.device if old.device.type != "meta" else torch.device("cpu")
        setattr(mod, name, nn.Parameter(torch.empty(0, dtype=old.dtype, device=device),
                                        requires_grad=False))
        del old
