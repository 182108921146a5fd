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
