"""The validation table: every paper number beside ours with the ratio, per profile, from
records (synthetic here; experiments.validate runs the real cases)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from experiments import validate
from experiments.plots import paper


def _row(hw, model, system, budget="high", **kw):
    return {"hardware": hw, "model": model, "system": system, "budget": budget,
            "experiment": "validate", **kw}


def synthetic(scale: float) -> list[dict]:
    """Ours = paper x `scale` for every TPOT of the high budget."""
    rows = []
    hw = f"a100_pcie4_{'hf' if scale > 1 else 'ideal'}"
    for fam, model in validate.MODELS.items():
        tp = paper.TPOT_HIGH_MS[fam]
        for s in validate.MAIN_SYSTEMS:
            v = tp.get(s, 10.0) * scale
            rows.append(_row(hw, model, s, tpot_ms=v, h2d_hidden_frac=0.5, acceptance_rate=0.9,
                             k=16, distinct_experts_per_forward=20.0))
    ds = validate.MODELS["deepseek"]
    rows.append(_row(hw, ds, "specter", **{"cfg.system.orchestrator": False, "tpot_ms": 90.0}))
    for k, v in ((4, 80.0), (8, 70.0), (32, 95.0)):  # the K sweep: K*=8 beats the main case's K=16
        rows.append(_row(hw, ds, "specter", **{"cfg.spec.k": k, "tpot_ms": v * scale, "k": k}))
    rows.append(_row(hw, ds, "specter", **{"cfg.system.prefetch_noise": 0.75, "tpot_ms": 99.0,
                                           "prefetch_precision": 0.3}))
    for gb in validate.HIT_RATE_GB:
        rows.append(_row(hw, ds, "specter", budget="gb", budget_gb=gb, budget_slots=gb,
                         hit_rate=0.5, hit_rate_cap=0.6, hit_rate_tokens=0.7, plan_recall=0.8))
    for s, (p_tpot, p_tput) in paper.BATCH32_DEEPSEEK.items():  # one batch of 32 rows each
        for i in range(validate.BATCH):
            rows.append(_row(hw, ds, s, **{"cfg.workload.batch": validate.BATCH,
                                           "tpot_ms": p_tpot * scale + (i % 2),
                                           "batch_id": "r0-000", "repeat": 0,
                                           "batch_tokens_per_s": p_tput / scale}))
    return rows


def test_table_has_every_quantity_with_ratios_per_profile():
    df = pd.DataFrame(synthetic(1.0) + synthetic(2.0))
    for c in ("cfg.system.orchestrator", "cfg.system.prefetch_noise"):
        df[c] = df[c].where(df[c].notna(), None)
    t = validate.table(df)
    assert {"quantity", "model", "system", "profile", "paper", "ours", "ratio"} <= set(t.columns)
    assert set(t["profile"]) == {"a100_pcie4_ideal", "a100_pcie4_hf"}
    tpot = t[t["quantity"] == "TPOT at the high budget (ms)"]
    # Every published high-budget TPOT of a system we run: 5 Qwen, 5 Phi, 2 DeepSeek.
    assert len(tpot) == 2 * 12
    ideal = tpot[tpot["profile"] == "a100_pcie4_ideal"]["ratio"]
    hf = tpot[tpot["profile"] == "a100_pcie4_hf"]
    assert ideal.tolist() == pytest.approx([1.0] * 12)
    eager = hf["system"] != "vllm_offload"
    assert hf[eager]["ratio"].tolist() == pytest.approx([2.0] * 10)
    # vLLM is an optimised engine: every profile's row holds the ideal profile's number
    assert hf[~eager]["ratio"].tolist() == pytest.approx([1.0] * 2)
    assert (hf[~eager]["note"] == "ours on the ideal profile (vLLM's engine)").all()
    sp = t[t["quantity"] == "speedup of Specter over SpecMoEOff"]
    assert sp["ratio"].tolist() == pytest.approx([1.0] * 4)  # ratios of ratios cancel the scale
    abl = t[t["quantity"] == "ablation: no PIO (ms/token)"]
    assert abl["ours"].tolist() == [90.0, 90.0]
    hr = t[t["quantity"] == "hit rate at 24 GiB"].iloc[0]
    assert hr["ours"] == 0.5 and "cap slots/distinct 0.600" in hr["note"]
    rob = t[t["quantity"] == "robustness: TPOT, wrong prefetch (ms)"]
    assert rob["ours"].tolist() == [99.0, 99.0]
    kstar = t[(t["quantity"] == "chosen depth K* (argmin TPOT)") & (t["model"] == "deepseek")]
    assert kstar["ours"].tolist() == [8.0, 8.0] and kstar["paper"].tolist() == [16, 16]
    b_tpot = t[t["quantity"] == "batch 32: TPOT (ms)"]
    assert len(b_tpot) == 2 * 4  # the batch rows stay out of the one-at-a-time TPOT above
    assert b_tpot[b_tpot["profile"] == "a100_pcie4_hf"]["ratio"].tolist() == \
        pytest.approx([2.0 + 0.5 / v[0] for v in paper.BATCH32_DEEPSEEK.values()])
    tput = t[t["quantity"] == "batch 32: throughput (tokens/s)"]
    assert tput[tput["profile"] == "a100_pcie4_hf"]["ratio"].tolist() == pytest.approx([0.5] * 4)
    over = t[t["quantity"].str.startswith("batch 32: throughput of Specter /")]
    assert len(over) == 2 * 3 and over["ratio"].tolist() == pytest.approx([1.0] * 6)
    med = validate.median_abs_log_ratio(t)
    assert med["a100_pcie4_ideal"] < med["a100_pcie4_hf"]
    for q in ("none", "no PIO+SIC"):  # not run here: ours is missing, never invented
        assert t[t["quantity"] == f"ablation: {q} (ms/token)"]["ours"].map(math.isnan).all()


def test_profile_free_numbers_and_the_written_files(tmp_path):
    fid = pd.DataFrame([{"model": m, "system": "fidelity", "fidelity_topk": 0.95}
                        for m in validate.MODELS.values()])
    t = validate.profile_free(fid)
    f = t[t["quantity"].str.startswith("routing fidelity")]
    assert len(f) == 3 and (f["profile"] == "-").all()
    mem = t[t["quantity"] == "GPU memory saving of sharing, Qwen 12K"].iloc[0]
    assert 0.2 < mem["ours"] < 0.6 and mem["paper"] == paper.MEMORY_QWEN_12K["saving"]
    paths = validate.write(tmp_path, t)
    assert "Median |log ratio|" in paths[0].read_text()
    assert len(pd.read_parquet(paths[1])) == len(t)


def test_cases_cover_both_profiles_and_the_paper_experiments():
    cs = validate.cases(validate.PROFILES)
    flat = [" ".join(c.overrides) for c in cs]
    for hw in validate.PROFILES:
        assert sum(f"hardware={hw}" in f and "budget=high" in f and "system=specter" in f
                   and "system." not in f.replace("system=", "") and "spec.k" not in f
                   for f in flat) == 3
        assert sum(f"hardware={hw}" in f and "spec.k=" in f for f in flat) == 3 * len(validate.DEPTHS)
        assert sum(f"hardware={hw}" in f and "budget.gb=" in f for f in flat) == 3
    assert sum("system=fidelity" in f for f in flat) == 3
    batch = [" ".join(c.overrides) for c in validate.batch_cases(validate.PROFILES)]
    assert len(batch) == 2 * 4 and all("workload.batch=32" in f and "dataset=mix" in f
                                       for f in batch)


def test_run_cases_runs_each_case_through_the_runner(tmp_path):
    """The cases go through run.py's own override checks and the runner (a batched one too)."""
    from experiments import records

    case = validate.Case(("hardware=a100_pcie4_hf", "model=tiny_deepseek", "system=lru",
                          "budget=high", "workload.batch=2"))
    common = ["workload.items=2", "workload.max_new_tokens=4", "workload.repeats=1"]
    assert validate.run_cases(tmp_path, [case], common, log=lambda *_: None) == 0
    df = records.load(tmp_path)
    assert len(df) == 2 and (df["experiment"] == "validate").all()
    assert (df["batch_size"] == 2).all() and (df["system"] == "lru").all()
    # a misspelt choice or knob is one failed case with its sentence, not the table's end
    said: list[str] = []
    bad = [validate.Case(("hardware=a100_pcie4_hff", "model=tiny_deepseek", "system=lru")),
           validate.Case(("hardware=a100_pcie4_hf", "model=tiny_deepseek", "system=lru",
                          "workload.itemz=2"))]
    assert validate.run_cases(tmp_path, bad, common, log=said.append) == 2
    assert sum("error: " in line for line in said) == 2 and "workload.items" in said[3]


def test_every_table_case_composes_and_passes_run_pys_checks():
    """validate's cases compose through run.py's own checks (specter.settings.run_config)."""
    from specter.settings import run_config

    for case in [*validate.cases(validate.PROFILES), *validate.batch_cases(validate.PROFILES)]:
        run_config([*case.overrides, "experiment=validate", "workload.items=1"]).validate()
