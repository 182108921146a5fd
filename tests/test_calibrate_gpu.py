"""scripts/calibrate_gpu.py: the fits of its timings (specter/clock/calibration.py) recover
known values, the CPU smoke run writes a complete hardware profile, and the measured profile's
overrides compose into a valid RunConfig."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pandas as pd
import pytest

from specter.clock.calibration import (error_rows, fit_latency_bandwidth, fit_offload_layer,
                                         fit_overheads, summarize_records)

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "calibrate_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("calibrate_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cal = _load()
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, cal.DEEPSEEK_EXPERT_BYTES, 64 << 20, 256 << 20]


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_latency_and_bandwidth(relative):
    lat, bw = 12e-6, 55e9
    times = [lat + b / bw for b in SIZES]
    got_lat, got_bw = fit_latency_bandwidth(SIZES, times, relative=relative)
    assert got_lat == pytest.approx(lat, rel=1e-6)
    assert got_bw == pytest.approx(bw, rel=1e-9)


def test_fit_with_noise_keeps_the_latency():
    """1% multiplicative noise: the relative fit still finds the latency; an unweighted fit
    lets the largest copies decide it."""
    lat, bw = 8e-6, 50e9
    noise = [1.01, 0.99, 1.01, 0.99, 1.01, 0.99, 1.01, 0.99]
    times = [(lat + b / bw) * n for b, n in zip(SIZES, noise)]
    got_lat, got_bw = fit_latency_bandwidth(SIZES, times)
    assert got_lat == pytest.approx(lat, rel=0.15)
    assert got_bw == pytest.approx(bw, rel=0.02)


def test_fit_rejects_one_size():
    with pytest.raises(ValueError):
        fit_latency_bandwidth([1 << 20, 1 << 20], [1e-4, 1e-4])


def test_fit_overheads_inverts_the_cost_model():
    expert, layer = 150e-6, 700e-6
    expert_roof, rest, calls = 10e-6, 300e-6, 7  # 6 routed + 1 shared MLP call
    got = fit_overheads(layer_s=rest + calls * expert + layer, expert_call_s=expert_roof + expert,
                            expert_roofline_s=expert_roof, layer_rest_s=rest, n_mlp_calls=calls)
    assert got["expert_overhead_s"] == pytest.approx(expert)
    assert got["layer_overhead_s"] == pytest.approx(layer)
    clamped = fit_overheads(layer_s=1e-4, expert_call_s=1e-6, expert_roofline_s=2e-6,
                                layer_rest_s=2e-4, n_mlp_calls=7)
    assert clamped["expert_overhead_s"] == 0.0 and clamped["expert_overhead_raw_s"] < 0
    assert clamped["layer_overhead_s"] == 0.0 and clamped["layer_overhead_raw_s"] < 0


def test_error_rows_from_records():
    real = pd.DataFrame({"system": ["resident", "resident", "lru"], "tpot_ms": [10.0, 12.0, 20.0],
                         "h2d_hidden_frac": [math.nan, math.nan, 0.5]})
    virt = pd.DataFrame({"system": ["resident", "lru"], "tpot_ms": [5.5, 30.0],
                         "h2d_hidden_frac": [math.nan, 0.25]})
    rows = error_rows(summarize_records(real), {"measured": summarize_records(virt)},
                          ["resident", "lru", "specter"])
    by = {r["system"]: r for r in rows}
    assert by["resident"]["measured_tpot_ms"] == 11.0
    assert by["resident"]["ratio_virtual_over_measured"] == pytest.approx(0.5)
    assert by["lru"]["ratio_virtual_over_measured"] == pytest.approx(1.5)
    assert by["lru"]["measured_hidden_frac"] == 0.5 and by["lru"]["virtual_hidden_frac"] == 0.25
    assert math.isnan(by["specter"]["ratio_virtual_over_measured"])
    md = cal.rows_markdown(rows, "t")
    assert md.count("\n| ") == 4  # header + 3 rows


def test_summary_drops_the_warm_up_repeat():
    df = pd.DataFrame({"system": ["lru"] * 4, "repeat": [0, 1, 0, 1], "tpot_ms": [90.0, 10.0, 50.0, 12.0],
                       "h2d_hidden_frac": [0.1, 0.5, 0.1, 0.7]})
    got = summarize_records(df)["lru"]
    assert got["tpot_ms"] == 11.0 and got["hidden_frac"] == pytest.approx(0.6) and got["rows"] == 2
    assert summarize_records(df[df["repeat"] == 0])["lru"]["rows"] == 2  # one repeat: all kept


def test_cpu_quick_writes_a_complete_profile(tmp_path):
    from specter.config import HardwareConfig, _build
    from specter.clock.timing import profile_of

    out = tmp_path / "cal"
    p = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out),
                        "--threads", "1", "--stages", "launch,h2d,hbm,roles,profile"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "calibrate_gpu:" in p.stdout
    values = cal.load_profile_yaml(out / "hardware_measured.yaml")
    # every key a GPU profile sets (conf/hardware/h200_hf.yaml), each one a HardwareConfig field
    stock = cal.load_profile_yaml(REPO / "conf" / "hardware" / "h200_hf.yaml")
    assert set(stock) <= set(values), set(stock) - set(values)
    known = {f.name: f for f in fields(HardwareConfig)}
    assert set(values) <= set(known), set(values) - set(known)
    required = {n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING}
    assert required <= set(values)
    floats = {n for n, f in known.items() if f.type == "float"}
    assert floats & set(stock) <= set(cal.NUMERIC_KEYS)
    for key in cal.NUMERIC_KEYS:
        # framework overheads are fitted residuals clamped at 0 (a noisy run on a busy CPU can
        # put the roofline above the measurement); rates and latencies must be positive
        fitted = ("layer_overhead_s", "expert_overhead_s", "draft_overhead_s", "offload_layer_overhead_s")
        low = 0 if key in fitted else 1e-300
        assert isinstance(values[key], float) and values[key] >= low and math.isfinite(values[key]), key
    assert values["offload_layer_overhead_s"] == 0.0
    import yaml  # plain PyYAML reads the numbers as numbers too

    assert yaml.safe_load((out / "hardware_measured.yaml").read_text())["h2d_latency_s"] > 0
    hw = _build(HardwareConfig, values, "hardware.")
    assert profile_of(hw).engine == "hf"
    data = json.loads((out / "calibration.json").read_text())
    stages = data["stages"]
    assert "skipped" in stages["h2d"]  # no pinned memory on a CPU
    for name in ("launch", "hbm", "roles", "profile"):
        assert "error" not in stages[name], stages[name]
    fit = stages["roles"]["fit"]
    assert fit["model"] == "deepseek" and fit["layer_overhead_s"] >= 0
    # the measured profile, passed as overrides, composes into the same hardware config
    from specter.settings import compose_run_config

    run_cfg = compose_run_config(cal.measured_overrides(values, "h200_measured")
                                 + ["hardware.charge=own"])
    for key in cal.NUMERIC_KEYS:
        assert getattr(run_cfg.hardware, key) == pytest.approx(values[key], rel=1e-12), key
    assert run_cfg.hardware.name == "h200_measured" and run_cfg.hardware.charge == "own"


def test_fit_offload_layer_is_the_gap_beyond_the_virtual_clock():
    real = {"lru": {"tpot_ms": 10.0}, "resident": {"tpot_ms": 7.0}}
    virtual = {"lru": {"tpot_ms": 9.0}, "resident": {"tpot_ms": 8.5}}  # charges 0.5 ms of waits
    fit = fit_offload_layer(real, virtual, moe_layers=3)
    assert fit["gap_ms"] == pytest.approx(2.5)
    assert fit["offload_layer_overhead_s"] == pytest.approx(2.5e-3 / 3)
    faster = {"lru": {"tpot_ms": 7.0}, "resident": {"tpot_ms": 7.0}}  # virtual already above
    clamped = fit_offload_layer(faster, virtual, moe_layers=3)
    assert clamped["offload_layer_overhead_s"] == 0.0 and clamped["offload_layer_overhead_raw_s"] < 0
    assert fit_offload_layer({"resident": {"tpot_ms": 7.0}}, virtual, 3) is None


def test_profile_numbers_reads_a_profile_without_the_draft_and_offload_costs():
    stock = cal.load_profile_yaml(REPO / "conf" / "hardware" / "h200_hf.yaml")
    nums = cal.profile_numbers(stock)  # draft_overhead_s: null there
    assert nums["draft_overhead_s"] == nums["expert_overhead_s"] == stock["expert_overhead_s"]
    older = {k: v for k, v in stock.items() if k not in ("draft_overhead_s", "offload_layer_overhead_s")}
    assert cal.profile_numbers(older) == nums and nums["offload_layer_overhead_s"] == 0.0


def test_the_measured_h200_profile_is_the_run_that_measured_it():
    """conf/hardware/h200_measured_constants.yaml carries the numbers of the H200 run whose
    records sit under docs/measurements/ (no value tuned by hand after the fact); the counted
    h200_measured has the same device rates and the host rates the fit on those records gives
    (experiments/counted_fit.py, recomputed here from the stored counts)."""
    from experiments import counted_fit

    conf = cal.load_profile_yaml(REPO / "conf" / "hardware" / "h200_measured_constants.yaml")
    run = cal.load_profile_yaml(REPO / "docs" / "measurements" / "h200-2026-11-30"
                                / "hardware_measured_run4.yaml")
    for key in cal.NUMERIC_KEYS:
        assert conf[key] == pytest.approx(run[key], rel=1e-9), key
    counted = cal.load_profile_yaml(REPO / "conf" / "hardware" / "h200_measured.yaml")
    for key in ("matrix_flops", "mem_bandwidth_Bps", "h2d_bandwidth_Bps", "h2d_latency_s"):
        assert counted[key] == pytest.approx(run[key], rel=1e-9), key
    table = counted_fit.build(counted_fit.DIR / "counts_968087c.csv",
                              counted_fit.DIR / "virtual_zero_968087c.csv", counted_fit.REAL,
                              "run2_bench", 1)
    op_s, sync_s = counted_fit.fit(table, ["resident", "lru"])
    assert counted["host_op_s"] == pytest.approx(op_s, rel=1e-4)
    assert counted["sync_s"] == pytest.approx(sync_s, rel=1e-4)
    for key in ("launch_overhead_s", "layer_overhead_s", "expert_overhead_s",
                "offload_layer_overhead_s"):
        assert counted[key] == 0, key
    table = pd.read_csv(REPO / "docs" / "measurements" / "h200-2026-11-30" / "error_table_run4.csv")
    held_out = table[(table.system == "specter") & (table.profile == "measured_fit")]
    assert len(held_out) == 1  # the check the profile's header quotes
    assert abs(float(held_out.ratio_virtual_over_measured.iloc[0]) - 1) < 0.05
