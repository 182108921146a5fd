"""Engine profiles: the framework costs are charged where the cost model says, the *_hf and
*_ideal yamls hold the fit of the cited measurements (specter/clock/calibration.py), and
the fit itself recovers known overheads from synthetic measurements."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from specter.models.real_configs import REAL_CONFIGS
from specter.clock import calibration as cal
from specter.clock.costmodel import CostModel, HardwareProfile, real_charged_sizes

CONF = Path(__file__).resolve().parents[1] / "conf" / "hardware"
IDEAL = HardwareProfile("a100_pcie4_ideal", 312e12, 1.555e12, 5e-6, 31.5e9, 10e-6)


def test_framework_costs_are_charged_per_layer_and_per_mlp_call():
    """A modelled 4-layer DeepSeek-shaped model standing for DeepSeek-V2-Lite: the per-layer
    cost is charged once per real layer (attention x 27/4), the per-call cost once per real MLP
    call (experts x 26/3); the fused INT4 draft layer pays one call, not one per expert."""
    sizes = real_charged_sizes(REAL_CONFIGS["deepseek"], modelled=(4, 3, 1))
    hf = replace(IDEAL, layer_overhead_s=4e-4, expert_overhead_s=2e-4, engine="hf")
    a, b = CostModel(IDEAL, sizes), CostModel(hf, sizes)
    assert b.attention_s(1, 100) - a.attention_s(1, 100) == pytest.approx(4e-4 * 27 / 4)
    assert b.expert_s(3) - a.expert_s(3) == pytest.approx(2e-4 * 26 / 3)
    assert b.shared_s(1) - a.shared_s(1) == pytest.approx(2e-4 * 26 / 3)
    assert b.dense_mlp_s(1) - a.dense_mlp_s(1) == pytest.approx(2e-4)
    assert b.draft_experts_s([1] * 6) - a.draft_experts_s([1] * 6) == pytest.approx(2e-4 * 26 / 3)
    assert b.router_s(1) == a.router_s(1) and b.lm_head_s(1) == a.lm_head_s(1)
    assert b.transfer_s(10**6) == a.transfer_s(10**6)  # the link is not the framework's


def test_profiles_hold_the_fit_of_the_cited_measurements():
    assert cal.main([]) == 0  # every *_hf / *_ideal yaml matches its engine's fit
    for engine in ("hf", "ideal"):
        a, b, rows = cal.fit(engine=engine)
        assert a >= 0 and b >= 0 and any(r["use"] == "fit" for r in rows)
        for path in CONF.glob(f"*_{engine}.yaml"):
            y = yaml.safe_load(path.read_text())
            assert y["engine"] == engine and y["clock"] == "virtual"
    hf, ideal = cal.fit(engine="hf"), cal.fit(engine="ideal")
    assert hf[0] > 3 * ideal[0]  # eager frameworks pay far more per layer


def test_fit_recovers_known_overheads_from_synthetic_measurements():
    truth = (6e-4, 1.5e-4)
    synth = []
    for shapes in (cal.LLAMA_7B, cal.DEEPSEEK_MOE_16B, cal.QWEN2_7B):
        roof = cal.decode_step(CostModel(cal.A100_80GB, shapes.sizes()), shapes, 128)
        t = roof + shapes.layers * truth[0] + shapes.mlp_calls() * truth[1]
        synth.append(cal.Measurement("hf", "fit", shapes, cal.A100_80GB, 1 / t, 128, "synthetic"))
    a, b, rows = cal.fit(synth, "hf")
    assert (a, b) == pytest.approx(truth, rel=1e-6)
    assert all(r["fitted / measured"] == pytest.approx(1, rel=1e-2) for r in rows)
    # Negative residuals cannot make a negative overhead.
    fast = [replace(m, tokens_per_s=1 / (0.5 * m.measured_s)) for m in synth]
    a, b, _ = cal.fit(fast, "hf")
    assert a >= 0 and b >= 0
