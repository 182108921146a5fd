"""`system=host_experts_s`: host_experts (baselines/host_experts.py) with self-speculation:
the target's own INT4 experts on the device draft K tokens, and the target verifies them with
every routed expert computed on the host.

Whether it pays is the host's arithmetic: a window of K+1 tokens needs the union of their
experts, so the host reads more weights per forward than for one token, in exchange for the
tokens accepted. The records say which way it went (docs/host_experts.md).
"""

from __future__ import annotations

from specter.budget import Footprint
from specter.decoding.draft import SelfInt4Draft
from specter.decoding.engines import SpeculativeEngine, build_speculative
from specter.quant.build import int4_experts_for

ENGINE = SpeculativeEngine
FOOTPRINT = Footprint(int4_draft=True, host_experts=True)  # the INT4 copy; no expert slots


def build(job) -> SpeculativeEngine:
    draft = int4_experts_for(job)  # from the full-precision experts, before they move out
    return build_speculative(
        job, "host_experts_s",
        lambda timing, _, compiled: SelfInt4Draft(job.loaded.model, draft, job.device, timing,
                                                  compiled),
        host_all=True, int4=draft)
