"""`system=resident`: every expert on the device, plain greedy decoding.

The no-offload limit every other system is compared to, and the reference for losslessness:
its tokens must equal Hugging Face `generate` of the same model token for token. The experts
stay Hugging Face's own; under the virtual clock each step is charged by the cost model.
"""

from __future__ import annotations

import torch

from specter.engine import DeviceMemory, Generation, eos_ids, greedy_decode
from specter.offload.build import Timing


class ResidentEngine:
    name = "resident"

    def __init__(self, model, device: torch.device, stop_on_eos: bool = True,
                 timing: Timing | None = None):
        self.model, self.device = model, device
        self.timing = timing or Timing.wall(device)
        self.stop = eos_ids(model) if stop_on_eos else set()
        self.memory = DeviceMemory(model, device)
        self.charger = self.timing.charger(model, charge_experts=True)

    def reset(self) -> None:
        """Nothing to reset but the clock's statistics: all experts are always resident."""
        self.timing.link.reset_stats()

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        gen = greedy_decode(self.model, prompt_ids, max_new_tokens, self.device, self.timing.link,
                            self.stop, self.memory, self.charger.begin_forward)
        gen.stats.update(self.timing.link_record())
        return gen


def build(ctx) -> ResidentEngine:
    from specter.offload.build import timing_for

    return ResidentEngine(ctx.loaded.model, ctx.device, stop_on_eos=ctx.cfg.workload.stop_on_eos,
                          timing=timing_for(ctx))
