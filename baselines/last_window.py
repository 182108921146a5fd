"""`system=last_window`: speculative decoding with the INT4 self-draft, and one prefetch per
window: the top-M experts per layer of the last verified window, by tokens routed to them,
loaded as soon as that window is verified so the copies run under the next window's draft.

A baseline users ask for (routing is temporally local, so the last window's hot experts are a
cheap guess at the next window's), and the demonstration of how a policy is added: this
file's policy class and recipe, one line in specter/registry.py, conf/system/last_window.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.config import SystemConfig
from specter.decoding.draft import SelfInt4Draft
from specter.budget import Footprint
from specter.decoding.engines import SpeculativeEngine, build_speculative
from specter.errors import UserError
from specter.offload.prefetch import WindowPrefetcher
from specter.quant.build import int4_experts_for

ENGINE = SpeculativeEngine
FOOTPRINT = Footprint(int4_draft=True)  # the INT4 copy on the device (budget.gb)


@dataclass
class Config(SystemConfig):
    top_m: int | None = None  # experts per layer to prefetch; None: the model's top-k

    def validate(self) -> None:
        if self.top_m is not None and self.top_m < 1:
            raise UserError(f"system.top_m must be at least 1 (got {self.top_m}).")


class LastWindowPrefetch(WindowPrefetcher):
    """After each verification: per MoE layer, the `top_m` experts verification routed the
    most tokens to (ties: lower id) that are not resident are loaded."""

    def __init__(self, runtime, top_m: int):
        self.runtime, self.top_m = runtime, top_m
        self.prefetched = 0

    def window_end(self) -> None:
        for layer, counts in self.runtime.stats.last_counts.items():
            ranked = sorted(counts, key=lambda e: (-counts[e], e))[:self.top_m]
            self.prefetched += self.runtime.prefetch(layer, ranked, count=False)

    def reset(self) -> None:
        self.prefetched = 0

    def as_record(self) -> dict:
        return {"window_prefetches": self.prefetched, "top_m": self.top_m}


def build(job) -> SpeculativeEngine:
    draft = int4_experts_for(job)
    top_m = job.system.top_m or job.loaded.spec.top_k
    return build_speculative(
        job, "last_window",
        lambda timing, _, compiled: SelfInt4Draft(job.loaded.model, draft, job.device, timing,
                                                  compiled),
        window=lambda runtime, timing, _: LastWindowPrefetch(runtime, top_m), int4=draft)
