"""Issue 46 items 2-3: the virtual clock against the committed real-size H200 rows
(docs/measurements/h200-2026-12-04-random, experiments/clock_check.py).

The clock's prediction of every real row is recomputed from what its virtual twin recorded;
at the profile fit at real size (`h200_realsize`, fit on 16 GiB) the 24 GiB rows land within
the issue's bands, the small-model profile's rates do not, and a per-operation cost or a link
rate off by 2x in either direction leaves the bands.
"""

from __future__ import annotations

import dataclasses

import pytest

from experiments import clock_check as cc
from specter.compose import load_hardware


@pytest.fixture(scope="module")
def committed():
    df = cc.load_records()
    return df, cc.check(df, fit_budget=16)


def test_the_rows_are_the_committed_run_with_twins_that_decoded_the_same_tokens(committed):
    df, r = committed
    p = r["pairs"]
    assert len(p) == 12 and set(p["system"]) == {"lru", "specter"}
    assert set(p["budget_gb"]) == {16, 24}
    assert set(df["prov.git_commit"]) == {"21a1eef37534907b6fcbbc11102727c6b800d5fa"}
    # the first timed request of each system in the process: the one-off costs, excluded
    firsts = p[p["first_request"]]
    assert sorted(firsts["system"]) == ["lru", "specter"]
    assert (firsts["budget_gb"] == 16).all() and (firsts["request_id"] == "gsm8k-000").all()
    # a twin that decoded other tokens is not the same work: refused
    broken = df.copy()
    virt = broken.index[broken["clock"] == "virtual"][0]
    broken.at[virt, "output_tokens"] = list(broken.at[virt, "output_tokens"])[:-1] + [0]
    with pytest.raises(ValueError, match="other tokens"):
        cc.pairs(broken)


def test_the_real_size_profile_predicts_the_held_out_budget(committed):
    _, r = committed
    twin, fitted = r["twin"], r["fitted"]
    assert twin.host_op_s == pytest.approx(20.471e-6)  # h200_measured's, fit on small models
    assert not cc.within_bands(r["before"])  # the small-model rates: 0.6-0.7x of real
    assert (cc.summary(r["before"])["mean_err"] < -0.25).all()
    profile = load_hardware("h200_realsize")
    assert profile.host_op_s == pytest.approx(fitted.host_op_s, rel=1e-4)  # the yaml is the fit
    assert profile.sync_s == twin.sync_s and profile.h2d_bandwidth_Bps == twin.h2d_Bps
    held = r["held_out"]
    assert set(held["budget_gb"]) == {24} and len(held) == 6
    assert cc.within_bands(held), cc.summary(held)
    # the other way round holds too (fit on 24 GiB, checked on 16)
    df, _ = committed
    other = cc.check(df, fit_budget=24)
    assert cc.within_bands(other["held_out"]), cc.summary(other["held_out"])


@pytest.mark.parametrize("factor", [2.0, 0.5])
@pytest.mark.parametrize("rate", ["host_op_s", "h2d_Bps"])
def test_a_rate_off_by_2x_leaves_the_bands(committed, rate, factor):
    _, r = committed
    fitted, twin = r["fitted"], r["twin"]
    off = dataclasses.replace(fitted, **{rate: getattr(fitted, rate) * factor})
    kept = r["pairs"][~r["pairs"]["first_request"]]
    assert cc.within_bands(cc.replay(kept[kept["budget_gb"] == 24], fitted, twin))
    assert not cc.within_bands(cc.replay(kept[kept["budget_gb"] == 24], off, twin))
