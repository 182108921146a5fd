"""`system=sp_e` and `system=sp_l` (paper-facts.md, "SP-E / SP-L"): Specter's speculative
decoding and shared INT4 draft with one single prefetch plan per window instead of the
planner's phases: made from the ELB after the first draft step (early: little lookahead,
most overlap) or just before verification (late: the whole window's routing, no overlap
with the draft). Same plan rule (per layer, the top-M routed experts not resident, up to the
slots), same cache, same verification: the comparison isolates *when* to plan.
"""

from __future__ import annotations

from specter.system import SpecterEngine, build_planned

MODES = {"sp_e": "early", "sp_l": "late"}


def build(ctx) -> SpecterEngine:
    """A single plan may fill every slot: top_m defaults to the slots, not the top-k."""
    name = ctx.cfg.system.name
    return build_planned(ctx, name, MODES[name], default_top_m=ctx.budget.slots)
