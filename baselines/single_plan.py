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

from specter.decoding.engines import SpeculativeEngine
from specter.system import build_planned

ENGINE = SpeculativeEngine
MODES = {"sp_e": "early", "sp_l": "late"}


def build(ctx) -> SpeculativeEngine:
    name = ctx.cfg.system.name
    return build_planned(ctx, name, MODES[name])
