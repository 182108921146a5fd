"""The quick-vs-`--small` check (experiments/quick_ratio.py): SpecMoEOff's mean TPOT over
Specter's per model, budget and profile, the tuned SpecMoEOff left out, and the quick lead's
distance from `--small`'s."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.quick_ratio import compare, leads


def _rows(specter_ms, specmoeoff_ms, tuned_ms=None):
    rows = []
    for system, ms, tuned in (("specter", specter_ms, False), ("specmoeoff", specmoeoff_ms, False),
                              ("specmoeoff", tuned_ms, True)):
        if ms is None:
            continue
        for t in ms:
            rows.append({"model": "small_qwen", "budget": "high", "hardware": "a100_pcie4_hf",
                         "system": system, "tpot_ms": t, "cfg.spec.tune_own_k": tuned})
    rows.append({"model": "small_qwen", "budget": "high", "hardware": "a100_pcie4_hf",
                 "system": "resident", "tpot_ms": 1.0, "cfg.spec.tune_own_k": None})
    return pd.DataFrame(rows)


def test_the_lead_is_specmoeoffs_mean_over_specters_without_the_tuned_variant():
    t = leads(_rows([10.0, 30.0], [40.0, 60.0], tuned_ms=[1.0]))
    assert len(t) == 1 and t["lead"].iloc[0] == pytest.approx(50.0 / 20.0)


def test_the_quick_lead_is_compared_with_smalls():
    t = compare(_rows([20.0], [44.0]), _rows([20.0], [40.0]))
    assert t["quick vs small"].iloc[0] == pytest.approx(2.2 / 2.0 - 1.0)
    assert compare(_rows([20.0], [44.0]), _rows([20.0], None)).empty  # no SpecMoEOff in small


def test_the_same_datasets_columns_take_the_choice_of_datasets_out():
    def rows(by_dataset):
        out = []
        for ds, (sp, so) in by_dataset.items():
            r = _rows([sp], [so])
            r["dataset"] = ds
            out.append(r)
        return pd.concat(out, ignore_index=True)
    quick = rows({"gsm8k": (20.0, 40.0)})
    small = rows({"gsm8k": (20.0, 40.0), "humaneval": (20.0, 80.0)})
    t = compare(quick, small).iloc[0]
    assert t["lead small"] == pytest.approx(120.0 / 40.0)  # all datasets: 3x
    assert t["quick vs small"] == pytest.approx(2.0 / 3.0 - 1.0)
    assert t["lead small, quick's datasets"] == pytest.approx(2.0)  # gsm8k alone
    assert t["same datasets"] == pytest.approx(0.0)
