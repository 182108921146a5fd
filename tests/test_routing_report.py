"""The routing report's statistics on synthetic routing, its targets and acceptance walk, and
one pass on a tiny model (router and INT4 draft)."""

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


def test_target_band_passes_through_the_published_ends():
    assert rr.endpoint_17("deepseek") == pytest.approx(31.7)
    assert rr.endpoint_17("qwen") == pytest.approx(4 * 7.18)
    assert rr.endpoint_17("mixtral") is None and rr.target_band(None) == {}
    for fam, k in (("deepseek", 6), ("qwen", 4), ("phi", 2)):
        band = rr.target_band(fam)
        assert band[1] == pytest.approx((k, k))
        assert band[17][0] == pytest.approx(rr.endpoint_17(fam), rel=1e-6)
        assert band[17][1] == pytest.approx(rr.endpoint_17(fam), rel=1e-6)
        assert all(band[n][0] < band[n][1] for n in range(2, 17))  # two different shapes
    # a curve on the band's lower edge with the published end passes; 20% under it fails
    edge = {n: lo for n, (lo, _) in rr.target_band("deepseek").items()}
    assert rr.check(edge, "deepseek")["within"]
    low = {n: 0.8 * v for n, v in edge.items()}
    c = rr.check(low, "deepseek")
    assert not c["within"] and c["dev_17"] == pytest.approx(-0.2)
    assert c["worst_dev"] == pytest.approx(-0.2)


def test_acceptance_walk():
    assert rr.acceptance_at([True] * 10, 4) == 1.0
    assert rr.acceptance_at([False] * 10, 1) == 0.0
    # K = 2 over T T F T T: window 1 accepts 2 (p -> 3), window 2 at p=3 accepts T T (p -> 6)
    assert rr.acceptance_at([True, True, False, True, True], 2) == pytest.approx(4 / 4)
    # K = 4 over T F T T T T: window 1 accepts 1 of 4 (p -> 2), window 2 accepts 4 of 4
    assert rr.acceptance_at([True, False, True, True, True, True], 4) == pytest.approx(5 / 8)
    # deeper windows waste more drafts after a miss
    m = [True, True, True, False] * 8
    assert rr.acceptance_at(m, 1) > rr.acceptance_at(m, 16)


def test_report_on_a_tiny_model(monkeypatch):
    from specter.config import ModelConfig
    from specter.models.introspect import experts_modules
    from specter.placement.loader import load_model
    from specter.quant.calibrate import LayerReader

    # a fresh copy: the draft side switches the model's experts implementation
    lm = load_model(ModelConfig(name="tiny_deepseek", source="project"), torch.device("cpu"),
                    progress=False)
    reads, real = [], LayerReader.read
    monkeypatch.setattr(LayerReader, "read", lambda self, l: reads.append(l) or real(self, l))
    r = rr.model_report(lm.model, lm.tokenizer, "deepseek", items=1, tokens=18)
    # the draft's layers are read once each, one at a time, by the backend that copies them
    assert reads == list(range(len(experts_modules(lm.model))))
    ws = r["working_set"]
    k, e = r["top_k"], r["experts"]
    assert ws[1] == pytest.approx(k)  # one token needs exactly top-k experts
    # What the metric guarantees on any weights: a window of n tokens needs at least the k of
    # one token and at most n k, or all E. (It is not monotone in n: windows do not overlap,
    # so n = 9 averages two windows of 18 positions and n = 10 one.)
    assert all(k - 1e-9 <= ws[n] <= min(e, n * k) + 1e-9 for n in range(1, 18))
    assert 0 <= r["reuse"] <= 1 and 0 < r["load_entropy"] <= 1 and 0 < r["distinct_4"] <= 1
    assert 0 < r["fidelity_topk"] <= 1 and 0 <= r["draft_token_match"] <= 1
    assert set(r["acceptance"]) == set(rr.ACCEPT_KS)
    assert r["target"]["target_17"] == pytest.approx(31.7)
    md = rr.report({"x": r})
    assert "| x | deepseek | 64 / 6 |" in md and "[31.7]" in md


def test_unknown_model_is_one_sentence(capsys):
    assert rr.main(["--models", "no_such_model", "--out", "/tmp/unused"]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err
