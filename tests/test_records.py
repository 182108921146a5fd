"""Records: atomic rows, never overwritten, resumable, readable as one table."""

from __future__ import annotations

import pytest

from experiments import records


def _row(rid, rep, **extra):
    return {"request_id": rid, "repeat": rep, "output_tokens": [1, 2, 3], "tpot_ms": 1.5, **extra}


def test_write_load_and_refuse_overwrite(tmp_path):
    store = records.CaseStore(tmp_path, {"model": "m", "system": "s"})
    store.write(_row("a-000", 0))
    store.write(_row("a-000", 1, extra_stat=7))
    assert store.done("a-000", 0) and not store.done("a-001", 0)
    with pytest.raises(FileExistsError):
        store.write(_row("a-000", 0))
    df = records.load(tmp_path)
    assert len(df) == 2 and set(df["repeat"]) == {0, 1}
    assert list(df.loc[df["repeat"] == 0, "output_tokens"].iloc[0]) == [1, 2, 3]
    assert "extra_stat" in df.columns  # columns are the union over rows
    assert not list(store.dir.glob(".tmp-*"))


def test_case_ids_separate_configurations(tmp_path):
    a = records.CaseStore(tmp_path, {"model": "m", "system": "s", "seed": 0})
    b = records.CaseStore(tmp_path, {"seed": 0, "system": "s", "model": "m"})
    c = records.CaseStore(tmp_path, {"model": "m", "system": "s", "seed": 1})
    assert a.case_id == b.case_id != c.case_id


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    store = records.CaseStore(tmp_path, {"x": 1})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(records.pq, "write_table", boom)
    with pytest.raises(OSError):
        store.write(_row("a-000", 0))
    assert records.row_files(tmp_path) == []
    assert not list(store.dir.glob(".tmp-*"))


def test_agreement_counts_tokens_differing_from_resident(tmp_path, capsys):
    import pandas as pd

    from experiments import summarize

    case = {"model": "m", "budget_slots": 4, "hardware": "h", "clock": "cuda", "charged": "-",
            "dataset": "gsm8k", "batch_size": 1}
    rows = [dict(case, system="resident", budget="-", request_id="a", repeat=0, output_tokens=[1, 2, 3, 4]),
            dict(case, system="x", budget="low", request_id="a", repeat=0, output_tokens=[1, 2, 9, 4],
                 host_experts=5),
            dict(case, system="x", budget="low", request_id="b", repeat=0, output_tokens=[7]),  # no reference
            dict(case, system="y", budget="low", request_id="a", repeat=0, output_tokens=[1, 2])]
    out = summarize.agreement(pd.DataFrame(rows)).set_index("system")
    assert out.loc["x", "rows"] == 1 and out.loc["x", "tokens_differing"] == 1
    assert out.loc["x", "earliest_divergence"] == 2 and out.loc["x", "host_experts"] == 5
    assert out.loc["y", "tokens_differing"] == 2 and out.loc["y", "earliest_divergence"] == 2
    assert out.loc["y", "identical_rows"] == 0
    assert summarize.main([str(tmp_path), "--agreement", "--short"]) == 2  # one view at a time
