"""The routing report's statistics on synthetic routing, and one pass on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from experiments import routing_report as rr


def test_statistics_on_synthetic_routing():
    same = torch.tensor([[0, 1]] * 8)  # every token the same two experts
    assert rr.working_set(same, 1) == 2 and rr.working_set(same, 8) == 2
    assert rr.reuse(same) == 1.0
    fresh = torch.arange(16).reshape(8, 2)  # never an expert twice
    assert rr.working_set(fresh, 4) == 8 and rr.reuse(fresh) == 0.0
    assert math.isnan(rr.working_set(fresh, 9))  # no full window
    assert rr.load_entropy(fresh, 16) == pytest.approx(1.0)
    assert rr.load_entropy(same, 16) == pytest.approx(math.log(2) / math.log(16))
    assert rr.random_working_set(64, 6, 1) == pytest.approx(6.0)
    assert rr.random_working_set(64, 6, 17) == pytest.approx(64 * (1 - (58 / 64) ** 17))


def test_measure_on_a_tiny_model(tiny_models):
    lm = tiny_models("tiny_deepseek")
    prompts = [lm.tokenizer("def f(x):")["input_ids"], lm.tokenizer("The cat")["input_ids"]]
    r = rr.measure(lm.model, lm.tokenizer, prompts, tokens=18)
    ws = r["working_set"]
    assert ws[1] == pytest.approx(r["top_k"])  # one token needs exactly top-k experts
    assert all(ws[a] <= ws[b] + 1e-9 for a, b in zip(range(1, 17), range(2, 18)))
    assert ws[17] <= r["random_working_set"][17] * 1.2
    assert 0 <= r["reuse"] <= 1 and 0 < r["load_entropy"] <= 1 and 0 < r["distinct_4"] <= 1
    md = rr.report({"x": {**r, "stands_for": "deepseek", "paper": rr.paper_targets("deepseek")}})
    assert "| x | deepseek | 64 / 6 | 6.0 |" in md and "| 5.28x |" in md  # the paper's growth beside
