"""Budgets resolve to per-layer slot counts as in docs/paper-notes.md, and impossible ones fail."""

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


# ---------------------------------------------------------------------------- budget.gb
def _ds_spec():
    from transformers import AutoConfig

    from specter.budget import fp16_spec
    from specter.models.real_configs import REAL_CONFIGS

    return fp16_spec(AutoConfig.for_model(**REAL_CONFIGS["deepseek"]))


def test_gb_resolves_to_slots_by_hand_arithmetic():
    """DeepSeek-V2-Lite in FP16 at 24 GiB: what is left after the reserve, the non-expert
    weights, the KV cache and (for a drafting system) the INT4 copy of all 1664 routed experts,
    in slots of 26 layers x one 17.3 MB expert."""
    from specter.budget import GIB, Footprint, resolve_gb

    spec = _ds_spec()
    expert = 3 * 2048 * 1408 * 2
    assert spec.expert_bytes == expert and spec.num_moe_layers == 26
    int4 = 64 * 26 * (3 * 2048 * 1408 // 2 + 3 * 2048 * 1408 // 128 * 2)
    fixed = GIB + spec.non_expert_bytes + 144 * spec.kv_bytes_per_token
    specter = resolve_gb(24, spec, "real", Footprint(int4_draft=True), 144, 0, 1.0, 6)
    assert specter.slots == (24 * GIB - fixed - int4) // (26 * expert) == 32
    lru = resolve_gb(24, spec, "real", Footprint(), 144, 0, 1.0, 6)
    assert lru.slots == (24 * GIB - fixed) // (26 * expert) == 48
    staged = resolve_gb(24, spec, "real", Footprint(int4_draft=True), 144, 32, 1.0, 6)
    assert staged.slots == (24 * GIB - fixed - int4 - 32 * expert) // (26 * expert)
    two = resolve_gb(24, spec, "real", Footprint(int4_draft=True, second_instance=True), 144, 0, 1.0, 6)
    assert two.slots < specter.slots
    hf = resolve_gb(24, spec, "real", Footprint(whole_layers=True), 144, 0, 1.0, 6)
    assert hf.whole_layers == (24 * GIB - fixed) // (64 * expert) == 19 and hf.whole_layers_of == 26
    assert "INT4 draft" in specter.accounting and "INT4 draft" not in lru.accounting
    # The hit-rate study's budgets grow monotonically and stay at least top-k.
    slots = [resolve_gb(g, spec, "real", Footprint(int4_draft=True), 144, 0, 1.0, 6).slots
             for g in (16, 24, 32)]
    assert 6 <= slots[0] < slots[1] < slots[2] <= 64


def test_impossible_gb_budgets_are_one_sentence():
    from specter.budget import Footprint, resolve, resolve_gb
    from specter.config import RunConfig

    with pytest.raises(UserError, match="room for .* below the 6"):
        resolve_gb(12, _ds_spec(), "real", Footprint(int4_draft=True), 144, 0, 1.0, 6)
    with pytest.raises(UserError, match="budget=gb needs"):
        resolve(BudgetConfig(name="gb"), DS, None, 64, 6, Footprint(), 144)
    base = {"model": {"name": "x", "source": "project"}, "system": {"name": "lru"},
            "dataset": {"name": "gsm8k"}, "hardware": {"name": "cpu"}, "workload": {}}
    for budget, msg in (({"name": "gb", "gb": 24, "slots": 8}, "not both"),
                        ({"name": "gb", "gb": -1}, "budget.gb must be >= 0"),
                        ({"name": "gb", "gb": 0}, "positive"),
                        ({"name": "high", "staging": -1}, "staging")):
        with pytest.raises(UserError, match=msg):
            RunConfig.from_dict({**base, "budget": budget})


def test_named_budgets_carry_the_papers_gib_and_accelerate_sizes_from_it():
    from specter.budget import Footprint, resolve

    ds = ModelConfig(name="small_deepseek", source="project", stands_for="deepseek",
                     budget_slots={"high": 16, "low": 8}, budget_gb={"high": 24, "low": 18})
    r = resolve(BudgetConfig(name="high"), ds, None, 64, 6, Footprint(int4_draft=True), 144)
    assert (r.slots, r.gb, r.whole_layers) == (16, 24, None)  # the artifact's slots stay
    hf = resolve(BudgetConfig(name="high"), ds, None, 64, 6, Footprint(whole_layers=True), 144)
    assert hf.slots == 16 and hf.whole_layers == 19 and hf.gb == 24
    low = resolve(BudgetConfig(name="low"), ds, None, 64, 6, Footprint(whole_layers=True), 144)
    assert low.whole_layers < hf.whole_layers


def test_cpu_offload_gb_is_what_the_device_gib_does_not_hold():
    """vLLM's cpu_offload_gb from the GiB (system=vllm_offload): every FP16 weight, the KV cache
    and the reserve, minus the GiB, taken from the decoder layers (never the embeddings or
    the head); none when it all fits; one sentence when not even what stays fits."""
    from specter.budget import GIB, Footprint, resolve_gb

    spec = _ds_spec()
    fp = Footprint(offloads_weights=True)
    need = GIB + spec.non_expert_bytes + 144 * spec.kv_bytes_per_token \
        + 26 * 64 * spec.expert_bytes
    r = resolve_gb(24, spec, "real", fp, 144, 0, 1.0, 6)
    assert r.offload_bytes == need - 24 * GIB
    assert r.layer_bytes == spec.non_expert_bytes - spec.outside_layer_bytes + 26 * 64 * spec.expert_bytes
    assert 0 < r.offload_share < 1 and 0 < spec.outside_layer_bytes < spec.non_expert_bytes
    assert resolve_gb(48, spec, "real", fp, 144, 0, 1.0, 6).offload_bytes == 0
    with pytest.raises(UserError, match="does not hold the weights outside the decoder layers"):
        resolve_gb(1.2, spec, "real", fp, 144, 0, 1.0, 6)


def test_a_narrowed_model_charged_real_counts_the_real_models_gib(tmp_path):
    """model.narrow on a real model's key, on a clock charging its real sizes: a GiB budget
    holds the real model's slots (what the clock charges), not the narrow widths' many more;
    charged at its own sizes it counts its own bytes."""
    from specter.budget import bytes_spec
    from specter.models.published import write_config_folder

    narrow = {"hidden_size": 256, "moe_intermediate_size": 128, "vocab_size": 4096}
    folder = write_config_folder("deepseek", tmp_path / "narrow", layers=3, narrow=narrow)
    cfg = ModelConfig(name="deepseek", source="hf", narrow=narrow, layers=3)
    real, label = bytes_spec(cfg, folder, charged_real=True)
    own, own_label = bytes_spec(cfg, folder, charged_real=False)
    assert label.startswith("real:") and own_label.startswith("own:")
    assert real.num_experts == own.num_experts == 64
    assert real.expert_bytes == 88 * own.expert_bytes  # 2048 x 1408 against 256 x 128
