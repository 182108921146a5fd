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
