"""`system=lru_s`: self-speculative decoding with the INT4 draft, target experts loaded on
demand into the LRU cache at verification, no prefetch (docs/paper-notes.md, "LRU-S").

One model instance: the offloading runtime serves the target's experts, the INT4 copy the
draft's (device-resident, no transfers). Under the virtual clock the draft's experts are
charged at INT4 bytes; attention, shared experts and the lm head are charged by the same
hooks in both modes. Output: the target's greedy tokens (specter/decoding/loop.py).
"""

from __future__ import annotations

from specter.decoding.draft import SelfInt4Draft
from specter.budget import Footprint
from specter.decoding.engines import SpeculativeEngine, build_speculative
from specter.quant.build import int4_experts_for

ENGINE = SpeculativeEngine
FOOTPRINT = Footprint(int4_draft=True)  # the INT4 copy on the device (budget.gb)


def build(job) -> SpeculativeEngine:
    draft = int4_experts_for(job)  # from the full-precision experts, before they move out
    return build_speculative(
        job, "lru_s",
        lambda timing, _, compiled: SelfInt4Draft(job.loaded.model, draft, job.device, timing,
                                                  compiled),
        int4=draft)
