"""The placement plan: where each of a checkpoint's tensors goes, decided once per job.

Owns: the rule. Every routed expert's tensors (bytes.py `is_routed_expert`: the per-expert and
fused hub layouts) go to one place, `experts`: "device" (a resident system, and one that
offloads a model loaded whole: the transformers baseline's accelerate hooks, vLLM's modelled
offloader), "host" (the host store, pinned beside a GPU: every system that offloads experts;
the device never holds them) or "none" (a second instance whose experts are an INT4 copy);
every other tensor goes to the device.
Does not own: reading the tensors (loader.py), their bytes (bytes.py), which systems offload
(each system's recipe declares it: `OFFLOADS`, `LOADS_EXPERTS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXPERT_PLACES = ("device", "host", "none")


@dataclass(frozen=True)
class PlacementPlan:
    experts: str  # where the routed experts go: "device" | "host" | "none"
    pin: bool = False  # the host store in pinned memory (beside a GPU: copies are async DMAs)

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_PLACES:
            raise ValueError(f"experts={self.experts!r}: one of {EXPERT_PLACES}")


def plan_for(offloads: bool, loads_experts: str, device: torch.device) -> PlacementPlan:
    """A system's plan: everything on the device unless it offloads experts; an offloading
    system's experts in the host store unless it offloads a model loaded whole
    (`loads_experts="device"`)."""
    experts = loads_experts if offloads else "device"
    return PlacementPlan(experts, pin=experts == "host" and device.type == "cuda")


RESIDENT = PlacementPlan("device")  # everything on the device
