"""Sweeps through Hydra launchers: workers share one results tree without clashes.

A joblib sweep (two worker processes) and a submitit sweep (the SLURM plugin's local
executor) write two cases into one out_dir each; two processes running
the same case at once write each row exactly once and both exit 0; a row published by a
concurrent writer between the check and the publish is never overwritten; the SLURM launcher
config composes with the plugin's schema.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from experiments import records

TINY_RUN = ("model=tiny_deepseek", "hardware=a100_pcie4_ideal", "dataset=gsm8k",
            "workload.max_new_tokens=8", "progress=false")


def _results(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines()
            if line.startswith("RESULT ")]


def _assert_clean_tree(out_dir, expect_rows: int) -> "records.pd.DataFrame":
    df = records.load(out_dir)
    assert len(df) == expect_rows
    assert not df.duplicated(["case_id", "request_id", "repeat"]).any()
    assert not list((out_dir / "records").glob("*/.tmp-*"))  # no partial or leftover files
    for case_dir in (out_dir / "records").iterdir():
        assert json.loads((case_dir / "case.json").read_text())  # manifest whole
    return df


@pytest.mark.slow
def test_joblib_sweep_two_workers_one_tree(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    res = run_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "system=lru,lru_s",
                  f"out_dir={tmp_path}", *TINY_RUN, "workload.items=1", "workload.repeats=1")
    assert res.returncode == 0, res.stderr[-3000:]
    df = _assert_clean_tree(tmp_path, expect_rows=2)
    assert sorted(df["system"]) == ["lru", "lru_s"]
    assert df["case_id"].nunique() == 2
    assert {r["written"] for r in _results(res.stdout)} == {1}


@pytest.mark.slow
def test_submitit_local_sweep(tmp_path):
    """The SLURM plugin's local executor: each case a submitit job (own process and logs)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    res = run_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
                  "system=lru,lru_s", f"out_dir={tmp_path}", *TINY_RUN, "workload.items=1",
                  "workload.repeats=1")
    assert res.returncode == 0, res.stderr[-3000:]
    df = _assert_clean_tree(tmp_path, expect_rows=2)
    assert sorted(df["system"]) == ["lru", "lru_s"]
    logs = sorted((tmp_path / "hydra").glob("multirun-*/.submitit/*/*_log.out"))
    assert len(logs) == 2 and all(_results(f.read_text()) for f in logs)


@pytest.mark.slow
def test_same_case_twice_at_once_writes_each_row_once(tmp_path):
    args = [sys.executable, str(REPO / "run.py"), "system=lru", f"out_dir={tmp_path}",
            *TINY_RUN, "workload.items=2", "workload.repeats=2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    _assert_clean_tree(tmp_path, expect_rows=4)
    summaries = [s for out, _ in outs for s in _results(out)]
    assert len(summaries) == 2 and len({s["case_id"] for s in summaries}) == 1
    assert sum(s["written"] for s in summaries) == 4  # every row written by exactly one


def test_row_published_meanwhile_is_not_overwritten(tmp_path, monkeypatch):
    """The race the exists() check cannot see: another worker publishes the row while this
    one writes its temporary file. This writer gets FileExistsError (the runner skips the
    row); the other's file stays, and no temporary file is left."""
    winner = records.CaseStore(tmp_path, {"case": 1})
    loser = records.CaseStore(tmp_path, {"case": 1})
    real_write = records.pq.write_table

    def write_then_other_worker_finishes(table, where, **kw):
        real_write(table, where, **kw)
        monkeypatch.setattr(records.pq, "write_table", real_write)
        winner.write({"request_id": "a-000", "repeat": 0, "who": "winner"})

    monkeypatch.setattr(records.pq, "write_table", write_then_other_worker_finishes)
    with pytest.raises(FileExistsError):
        loser.write({"request_id": "a-000", "repeat": 0, "who": "loser"})
    df = records.load(tmp_path)
    assert list(df["who"]) == ["winner"]
    assert not list(winner.dir.glob(".tmp-*"))


def test_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    res = run_cli("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra",
                  "-p", "hydra.launcher")
    assert res.returncode == 0, res.stderr[-3000:]
    for line in ("partition: gpu", "gpus_per_node: 1", "tasks_per_node: 1",
                 "_target_: hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"):
        assert line in res.stdout


def test_depth_profile_measured_once_by_concurrent_workers(tmp_path, monkeypatch):
    """spec.k=auto from two workers at once: one measures, the other waits and reuses its K
    (a sweep's workers must not each profile, under each other's load, and disagree)."""
    import threading
    import time
    from types import SimpleNamespace

    from experiments import depth_profile as depth

    calls = []

    def slow_sweep(engine, prompts, ks, runs, max_new_tokens, log):
        calls.append(engine)
        time.sleep(0.5)
        return [{"k": k, "tpot_ms": float(abs(k - 4) + engine), "acceptance_rate": 1.0,
                 "samples": 1} for k in ks]

    monkeypatch.setattr(depth, "sweep", slow_sweep)
    monkeypatch.setattr(depth, "profile_prompts", lambda ctx: [[1, 2]])
    monkeypatch.setattr(depth, "profile_key", lambda ctx: {"key": 1})
    cfg = SimpleNamespace(spec=SimpleNamespace(profile_ks=[2, 4, 8], profile_runs=1),
                          workload=SimpleNamespace(max_new_tokens=4),
                          hardware=SimpleNamespace(clock="virtual"))
    ctx = SimpleNamespace(cfg=cfg)
    out = {}

    def worker(engine):
        out[engine] = depth.auto_depth(ctx, engine, tmp_path, log=lambda *_: None)

    threads = [threading.Thread(target=worker, args=(e,)) for e in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert {k for k, _, _ in out.values()} == {4}
    assert sorted(reused for _, _, reused in out.values()) == [False, True]
    assert not list((tmp_path / "depth").glob("*.tmp*"))
