"""`system=sp_e` and `system=sp_l` (docs/paper-notes.md, "SP-E / SP-L"): Specter's speculative
decoding and shared INT4 draft with one single prefetch plan per window instead of the
planner's phases: made from the ELB after the first draft step (early: little lookahead,
most overlap) or just before verification (late: the whole window's routing, no overlap
with the draft). Same plan rule (per layer, the top-M routed experts not resident, up to the
slots; M defaults to the slots as for specter), same cache, same verification (by default it
starts once the plan's batch has landed, `system.wait_last_batch`): the comparison isolates
*when* to plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.config import SystemConfig
from specter.budget import Footprint
from specter.decoding.engines import SpeculativeEngine
from specter.specter_recipe import SpecterConfig, build_planned

ENGINE = SpeculativeEngine
FOOTPRINT = Footprint(int4_draft=True)  # the INT4 copy on the device (budget.gb)
MODES = {"sp_e": "early", "sp_l": "late"}


@dataclass
class Config(SystemConfig):
    """The knobs sp_e / sp_l share with specter; every other rule is specter's default."""

    top_m: int | None = None  # experts per layer in the plan; None: the slots
    prefetch_noise: float = 0.0
    wait_last_batch: bool = True

    def validate(self) -> None:
        self.as_specter().validate()

    def as_specter(self) -> SpecterConfig:
        return SpecterConfig(name=self.name, top_m=self.top_m, prefetch_noise=self.prefetch_noise,
                             wait_last_batch=self.wait_last_batch)


def build(job) -> SpeculativeEngine:
    sc = job.system
    return build_planned(job, sc.name, MODES[sc.name], sc.as_specter())
