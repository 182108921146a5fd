"""Memory budgets: named budgets to resident expert slots per MoE layer, and the byte accounting.

Owns: resolving `budget=xhigh|high|low|full` (or `budget.slots=N`) for a model to a slot count,
checking it is possible (at least top-k, at most the expert count; a dense model cut into
expert-sized blocks, where top-k = E, streams its blocks and needs one slot), and the device-memory
accounting printed at the start of every run.
Does not own: which experts occupy the slots (the residency policy of the offloading runtime).

The paper's budgets are per-layer slot counts (paper-facts.md); models without a paper entry
use the same proportions as DeepSeek-V2-Lite and Qwen1.5-MoE: high = E/4, low = E/8, rounded
up, never below top-k. `xhigh` = E/2 is the largest budget of the hit-rate study (our reading
of DeepSeek-V2-Lite at 32 GB: twice the 24 GB case's slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specter.config import BudgetConfig, ModelConfig
from specter.errors import UserError
from specter.models.introspect import MoESpec

PROPORTION = {"xhigh": 1 / 2, "high": 1 / 4, "low": 1 / 8}


@dataclass(frozen=True)
class ResolvedBudget:
    name: str
    slots: int
    rule: str  # where the number came from, for the record
    note: str = ""  # a deviation from the paper's number, if any


def resolve_slots(budget: BudgetConfig, model: ModelConfig, num_experts: int,
                  top_k: int) -> ResolvedBudget:
    # A token holds its top-k experts at once; a dense FFN cut into expert-sized blocks (top-k
    # = E, the dense twin) computes its blocks one after another, so they stream through 1 slot.
    minimum = 1 if top_k == num_experts else top_k
    if budget.slots is not None:
        slots, rule, note = budget.slots, "budget.slots override", ""
    elif budget.name == "full":
        slots, rule, note = num_experts, "all experts resident", ""
    elif budget.name in model.budget_slots:
        slots, rule, note = model.budget_slots[budget.name], f"model.budget_slots.{budget.name}", ""
        if slots < minimum:  # Phi-3.5-MoE low: the paper keeps 1 of 16 resident with top-2
            note = (f"paper budget of {slots} slot(s) is below top-k={top_k}; raised to {minimum} "
                    "because experts in use are never evicted")
            slots, rule = minimum, rule + " (raised to top-k)"
    elif budget.name in PROPORTION:
        slots = max(minimum, math.ceil(num_experts * PROPORTION[budget.name]))
        rule, note = f"proportional: ceil(E*{PROPORTION[budget.name]}), at least top-k", ""
    else:
        raise UserError(f"budget '{budget.name}' has no slot count for model={model.name}; "
                        "use budget=high|low|full or set budget.slots=N.")
    if slots < minimum:
        need = (f"every token needs {top_k} experts resident at once" if minimum == top_k
                else "its dense blocks stream through one slot at a time")
        raise UserError(f"budget of {slots} expert slot(s) per layer is below top-k={top_k} for "
                        f"model={model.name}; {need}, so set budget.slots to at least {minimum}.")
    if slots > num_experts:
        raise UserError(f"budget of {slots} expert slots per layer exceeds the {num_experts} "
                        f"routed experts of model={model.name}; use at most {num_experts} "
                        "(budget=full).")
    return ResolvedBudget(name=budget.name, slots=slots, rule=rule, note=note)


@dataclass(frozen=True)
class ByteAccount:
    non_expert_bytes: int
    resident_expert_bytes: int  # slots x MoE layers x one expert
    all_expert_bytes: int  # every routed expert (what a no-offload system holds)
    kv_bytes: int  # KV cache at the longest sequence of the workload
    kv_tokens: int

    def table(self, slots: int, spec: MoESpec) -> str:
        gib = 1 << 30
        rows = [
            ("non-expert weights (embeddings, attention, norms, routers, shared experts, head)",
             self.non_expert_bytes),
            (f"resident expert slots: {slots} x {spec.num_moe_layers} MoE layers x "
             f"{spec.expert_bytes / 2**20:.3f} MiB", self.resident_expert_bytes),
            (f"KV cache at {self.kv_tokens} tokens", self.kv_bytes),
        ]
        total = sum(b for _, b in rows)
        lines = [f"  {name:<86} {b / gib:10.4f} GiB" for name, b in rows]
        lines.append(f"  {'total device bytes under this budget':<86} {total / gib:10.4f} GiB")
        lines.append(f"  {'(all routed experts, for reference)':<86} "
                     f"{self.all_expert_bytes / gib:10.4f} GiB")
        return "\n".join(lines)


def account(spec: MoESpec, slots: int, kv_tokens: int) -> ByteAccount:
    return ByteAccount(
        non_expert_bytes=spec.non_expert_bytes,
        resident_expert_bytes=spec.slot_bytes(slots),
        all_expert_bytes=spec.slot_bytes(spec.num_experts),
        kv_bytes=spec.kv_bytes_per_token * kv_tokens,
        kv_tokens=kv_tokens,
    )
