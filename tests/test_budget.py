"""Budgets resolve to per-layer slot counts as in paper-facts.md, and impossible ones fail."""

from __future__ import annotations

import pytest

from specter.budget import account, resolve_slots
from specter.config import BudgetConfig, ModelConfig
from specter.errors import UserError

DS = ModelConfig(name="deepseek", source="hf", budget_slots={"high": 16, "low": 8})
QWEN = ModelConfig(name="qwen", source="hf", budget_slots={"high": 15, "low": 8})
PHI = ModelConfig(name="phi", source="hf", budget_slots={"high": 2, "low": 1})
OTHER = ModelConfig(name="tiny_olmoe", source="project")


@pytest.mark.parametrize("model,e,k,budget,slots", [
    (DS, 64, 6, "high", 16), (DS, 64, 6, "low", 8), (DS, 64, 6, "full", 64),
    (QWEN, 60, 4, "high", 15), (QWEN, 60, 4, "low", 8),
    (PHI, 16, 2, "high", 2), (PHI, 16, 2, "low", 2),
    (OTHER, 64, 8, "high", 16), (OTHER, 64, 8, "low", 8),
    (ModelConfig(name="tiny_mixtral", source="project"), 8, 2, "high", 2),
])
def test_named_budgets(model, e, k, budget, slots):
    assert resolve_slots(BudgetConfig(name=budget), model, e, k).slots == slots


def test_phi_low_is_raised_to_top_k_with_a_note():
    b = resolve_slots(BudgetConfig(name="low"), PHI, 16, 2)
    assert b.slots == 2 and "below top-k" in b.note


def test_override_and_limits():
    assert resolve_slots(BudgetConfig(name="high", slots=6), DS, 64, 6).slots == 6
    with pytest.raises(UserError, match="below top-k=6"):
        resolve_slots(BudgetConfig(name="high", slots=5), DS, 64, 6)
    with pytest.raises(UserError, match="exceeds the 64 routed experts"):
        resolve_slots(BudgetConfig(name="high", slots=65), DS, 64, 6)
    with pytest.raises(UserError, match="no slot count"):
        resolve_slots(BudgetConfig(name="medium"), DS, 64, 6)


def test_byte_accounting_matches_hand_arithmetic(tiny_models):
    spec = tiny_models("tiny_deepseek").spec
    # One fp32 expert: gate+up [2I, H] and down [H, I] with H=64, I=32.
    assert spec.expert_bytes == (2 * 32 * 64 + 64 * 32) * 4
    acct = account(spec, slots=16, kv_tokens=144)
    assert acct.resident_expert_bytes == 16 * spec.num_moe_layers * spec.expert_bytes
    assert acct.all_expert_bytes == 64 * spec.num_moe_layers * spec.expert_bytes
    assert acct.kv_bytes == 144 * spec.kv_bytes_per_token
    assert "total device bytes" in acct.table(16, spec)
