"""The GPU check (scripts/gpu_check.sh) on the CPU: its default stage's driver
(experiments/gpu_check.py) end to end with a tiny model on a virtual clock, its table and the
predictions beside it, its deadline; the stages run in the order named; its GPU command lines
pass the run's own checks."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import time

import pandas as pd
import pytest

from conftest import REPO
from experiments import gpu_check

SCRIPT = REPO / "scripts" / "gpu_check.sh"
HEADER = ("gpu,system,budget_gb,tpot_ms,warm_tpot_ms,draft_ms_step,verify_ms_window,"
          "clock_commit,note")


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


def _dry(*args: str, **env: str) -> list[str]:
    done = _script(*args, GPU_CHECK_DRY_RUN="1", **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[1::2]  # "stage NAME" lines


def test_stages_run_in_the_order_named():
    assert _dry() == ["default"]  # no arguments: the default stage alone
    assert _dry(STAGES="hotpath,inflated") == ["hotpath", "inflated"]
    assert _dry(STAGES="tests inflated default") == ["tests", "inflated", "default"]
    assert _dry("real_size", "tests", STAGES="inflated") == ["real_size", "tests"]  # args win
    done = _script("tests,nope", GPU_CHECK_DRY_RUN="1")
    assert done.returncode == 2 and "unknown stage 'nope'" in done.stderr


def test_the_default_stage_calls_the_driver_with_its_budget(tmp_path):
    log = tmp_path / "argv.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {shlex.quote(str(log))}\n'
                    f'echo >> {shlex.quote(str(log))}\n')
    stub.chmod(0o755)
    done = _script(PY=str(stub), OUT=str(tmp_path / "out"), CHECK_ARGS="--systems lru")
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert calls[0][0] == "-c"  # the environment's header
    assert calls[1:] == [["-m", "experiments.gpu_check", str(tmp_path / "out" / "default"),
                          "--budget-s", "300", "--tests-timeout-s", "150", "--systems", "lru"]]


def test_the_gpu_jobs_pass_the_runs_own_checks(tmp_path):
    """The default stage's jobs on a GPU: every system at 16 GiB before any at 24, resident
    once at full, specter_hybrid on the measured profile's rates in real time; each job's
    overrides pass run.py's checks and compose."""
    from specter.settings import checked_overrides, run_config

    todo = gpu_check.jobs(gpu_check.SYSTEMS, gpu_check.BUDGETS)
    assert [j.label for j in todo] == [
        "lru @ 16 GiB", "specter @ 16 GiB", "specter_hybrid @ 16 GiB", "specmoeoff @ 16 GiB",
        "lru @ 24 GiB", "specter @ 24 GiB", "specter_hybrid @ 24 GiB", "specmoeoff @ 24 GiB",
        "resident @ full"]
    base = gpu_check.base_overrides("deepseek", "inflated", 3, 64, tmp_path)
    for job in todo:
        args = [*base, *job.overrides("cuda")]
        assert len(checked_overrides(args)) == len(args)
        cfg = run_config(args)
        assert cfg.model.weights == "inflated" and cfg.workload.max_new_tokens == 64
        assert cfg.system.name == job.system
        if job.system == "specter_hybrid":
            assert cfg.hardware.name == "h200_measured" and cfg.hardware.clock == "wall"
        else:
            assert cfg.hardware.name == "cuda"
        assert (cfg.budget.name, cfg.budget.gb) == (("full", None) if job.budget == "full"
                                                    else ("gb", float(job.budget)))


def test_the_prediction_csv_is_parsed_and_matched(tmp_path):
    shipped = (REPO / "docs" / "measurements" / "gpu-predictions.csv").read_text()
    assert shipped.splitlines()[0] == HEADER
    rows = gpu_check.read_predictions()  # the clock's rows (experiments.gpu_predictions)
    assert set(rows["gpu"]) <= set(gpu_check.GPUS)
    assert (rows["clock_commit"].str.len() >= 7).all() and rows["pred_tpot_ms"].gt(0).all()
    assert gpu_check.gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_check.gpu_kind("NVIDIA H200") == "H200"
    assert gpu_check.gpu_kind("NVIDIA A100-SXM4-80GB") is None and gpu_check.gpu_kind(None) is None
    path = tmp_path / "p.csv"
    path.write_text(HEADER + "\nH100,specter,16,20.5,18,0.9,150,abc123,\n"
                    "h200,specter,16,15,,,,abc123,\nH100,resident,,9,8,,,abc123,full budget\n")
    p = gpu_check.read_predictions(path, "H100").set_index(["system", "budget_key"])
    assert list(p.index) == [("specter", "16 GiB"), ("resident", "full")]
    assert p.loc[("specter", "16 GiB"), "pred_tpot_ms"] == 20.5
    assert p.loc[("specter", "16 GiB"), "pred_verify_ms_window"] == 150
    assert math.isnan(p.loc[("resident", "full"), "pred_draft_ms_step"])
    h200 = gpu_check.read_predictions(path, "H200")
    assert len(h200) == 1 and math.isnan(h200["pred_warm_tpot_ms"].iloc[0])
    assert len(gpu_check.read_predictions(path)) == 3
    (tmp_path / "bad.csv").write_text("gpu,system\nH100,lru\n")
    with pytest.raises(ValueError, match="missing column"):
        gpu_check.read_predictions(tmp_path / "bad.csv")


def test_a_job_past_the_deadline_is_cut():
    began = time.monotonic()
    with pytest.raises(gpu_check.OutOfTime):
        with gpu_check.deadline(0.05):
            time.sleep(5)
    assert time.monotonic() - began < 2


def test_the_driver_runs_on_the_cpu(tmp_path, capsys):
    """The default stage's driver with a tiny model on a virtual clock (1 item x 8 tokens, lru
    and specter at 16 GiB): rows, the table under OUT (markdown and csv) with the predictions
    of the GPU named beside the real values, "-" where the records lack kernels; then, with no
    time left, every job skipped with a line and the table still written."""
    pred = tmp_path / "pred.csv"
    pred.write_text(HEADER + "\nH100,specter,16,10,8,0.5,40,abc123,\nH200,specter,16,1,1,1,1,x,\n")
    out = tmp_path / "gc"
    common = ["--model", "tiny_deepseek", "--weights", "checkpoint", "--hardware",
              "a100_pcie4_hf", "--items", "1", "--tokens", "8", "--budgets", "16", "--gpu",
              "H100", "--predictions", str(pred), "--h2d-gbps", "25", "--no-tests"]
    assert gpu_check.main([str(out), "--systems", "lru,specter", *common]) == 0
    printed = capsys.readouterr().out
    assert "predictions: 1 row(s) for H100" in printed
    t = pd.read_csv(out / "gpu_check.csv").set_index("system")
    assert set(t.index) == {"lru", "specter"} and (t["budget_key"] == "16 GiB").all()
    assert t[["tpot_ms", "tpot_ms_after_first", "hit_rate", "h2d_MB_per_token",
              "link_floor_ms"]].notna().all().all()
    assert t.loc["lru", "over_lru"] == 1.0
    spec = t.loc["specter"]
    assert spec["draft_ms_step"] > 0 and spec["verify_ms_window"] > 0
    assert math.isnan(t.loc["lru", "draft_ms_step"])  # no draft
    assert spec["pred_tpot_ms"] == 10 and spec["tpot_ms_over_pred"] == pytest.approx(
        spec["tpot_ms"] / 10)
    assert spec["draft_ms_step_over_pred"] == pytest.approx(spec["draft_ms_step"] / 0.5)
    assert math.isnan(t.loc["lru", "pred_tpot_ms"])
    md = (out / "gpu_check.md").read_text()
    assert "| TPOT ms |" in md and "kernels/draft step" in md and "TPOT/pred" in md
    lru_line = next(line for line in md.splitlines() if line.startswith("| lru "))
    assert " - |" in lru_line  # no kernels, no prediction
    # out of time: nothing more runs, the table holds what completed
    assert gpu_check.main([str(out), "--systems", "specmoeoff", "--budget-s", "0",
                           *common]) == 0
    printed = capsys.readouterr().out
    assert "SKIPPED specmoeoff @ 16 GiB: out of time" in printed
    assert set(pd.read_csv(out / "gpu_check.csv")["system"]) == {"lru", "specter"}
