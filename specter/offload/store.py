"""Host-side expert store: every routed expert of every MoE layer as one flat buffer.

Owns: moving a model's routed-expert weights out of its fused 3D parameters into one
contiguous host buffer per (layer, expert) (pinned on CUDA so a copy is one async DMA), and
viewing a flat buffer, host or device, as that expert's (gate_up [2I, H], down [H, I]).
Does not own: the device slots or what is resident (cache.py), timing (link.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specter.models.introspect import experts_modules


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


class HostExpertStore:
    """flat[l][e]: the host copy of expert e of MoE layer l (l counts MoE layers only)."""

    def __init__(self, model: nn.Module, pin: bool):
        self.layers: list[int] = []  # decoder-layer index of each MoE layer
        self.flat: list[list[torch.Tensor]] = []
        self.layout: ExpertLayout | None = None
        for layer_idx, mod in experts_modules(model):
            e, two_i, h = mod.gate_up_proj.shape
            layout = ExpertLayout(num_experts=e, inter=two_i // 2, hidden=h,
                                  dtype=mod.gate_up_proj.dtype)
            assert self.layout in (None, layout), "all MoE layers must share one expert layout"
            self.layout = layout
            gate_up = mod.gate_up_proj.detach()
            down = mod.down_proj.detach()
            buffers = []
            for j in range(e):
                flat = torch.empty(layout.numel, dtype=layout.dtype, pin_memory=pin)
                g, d = layout.views(flat)
                g.copy_(gate_up[j])
                d.copy_(down[j])
                buffers.append(flat)
            self.layers.append(layer_idx)
            self.flat.append(buffers)
            # The layer's fused copies go as soon as the store holds it: the host (or the
            # device) keeps one copy of the experts, plus at most one layer while converting.
            del gate_up, down
            mod._specter_moe_layer = len(self.flat) - 1  # still an experts module, by its tag
            for name in ("gate_up_proj", "down_proj"):
                old = getattr(mod, name)
                setattr(mod, name, nn.Parameter(torch.empty(0, dtype=old.dtype, device=old.device),
                                                requires_grad=False))
                del old

    @property
    def num_moe_layers(self) -> int:
        return len(self.flat)

    def expert(self, moe_layer: int, expert: int) -> torch.Tensor:
        return self.flat[moe_layer][expert]
