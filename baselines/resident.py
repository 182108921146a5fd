"""`system=resident`: every expert on the device, plain greedy decoding.

The no-offload limit every other system is compared to, and the reference for losslessness:
its tokens must equal Hugging Face `generate` of the same model token for token.
Owns: the prefill + one-token-at-a-time greedy loop with commit timestamps.
"""

from __future__ import annotations

import torch

from specter.engine import (DeviceMemory, Generation, WallClock, eos_ids, forward_logits,
                            greedy_token, new_cache)


class ResidentEngine:
    name = "resident"

    def __init__(self, model, device: torch.device, stop_on_eos: bool = True):
        self.model = model
        self.device = device
        self.clock = WallClock(device)
        self.stop = eos_ids(model) if stop_on_eos else set()
        self.memory = DeviceMemory(model, device)

    def reset(self) -> None:
        """Nothing to reset: all experts are always resident."""

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        self.memory.start()
        cache = new_cache(self.model)
        ids = torch.tensor([prompt_ids], device=self.device)  # [1, P]
        start = self.clock.now()
        tokens: list[int] = []
        times: list[float] = []
        # 1. Prefill the prompt; its last logits give the first token.
        logits = forward_logits(self.model, ids, cache)  # [1, V]
        while True:
            # 2. Commit the greedy token.
            tok = greedy_token(logits[-1])
            tokens.append(tok)
            times.append(self.clock.now())
            if len(tokens) >= max_new_tokens or tok in self.stop:
                break
            # 3. Decode one step.
            logits = forward_logits(self.model, torch.tensor([[tok]], device=self.device), cache)
        self.memory.observe_cache(cache)
        peak, source = self.memory.peak()
        return Generation(tokens=tokens, commit_times_s=times, start_time_s=start,
                          peak_mem_bytes=peak, peak_mem_source=source)


def build(ctx) -> ResidentEngine:
    return ResidentEngine(ctx.loaded.model, ctx.device, stop_on_eos=ctx.cfg.workload.stop_on_eos)
