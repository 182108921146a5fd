"""Faults and bad input: each one is one sentence (or one warning line), loses nothing, and
heals on the rerun. Table-driven where the check happens before any model loads."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from experiments import records, runner, summarize
from specter import compose
from test_runner import smoke_cfg


def _rows(tmp_path):
    """Published row files (not a writer's hidden temp file, which pathlib's glob also sees)."""
    return sorted(p for p in (tmp_path / "records").glob("*/*.parquet")
                  if not p.name.startswith("."))


# -- corrupt records ----------------------------------------------------------------------
CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "not parquet": lambda p: p.write_text("hello"),
    "foreign parquet": lambda p: pq.write_table(pa.table({"x": [1]}), p),  # no key columns
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_a_corrupt_row_is_quarantined_and_recomputed(tmp_path, capsys, how):
    cfg = smoke_cfg(tmp_path)  # 2 items x 2 repeats, resident, tiny
    quiet = lambda *_: None  # noqa: E731
    assert runner.run(cfg, log=quiet).written == 4
    victim = _rows(tmp_path)[1]
    good = pq.read_table(victim).to_pandas()
    CORRUPTIONS[how](victim)
    capsys.readouterr()
    # load and summarize skip it with one warning line and still show the rest
    df = records.load(tmp_path)
    err = capsys.readouterr().err
    assert len(df) == 3 and err.count("\n") == 1 and str(victim) in err
    assert summarize.main([str(tmp_path), "--short"]) == 0
    # the rerun moves it aside, says so once, and computes exactly that row again
    again = runner.run(cfg, log=quiet)
    assert (again.written, again.skipped) == (1, 3)
    assert victim.exists() and len(list((victim.parent / "quarantine").iterdir())) == 1
    df = records.load(tmp_path)
    assert len(df) == 4 and not df.duplicated(["request_id", "repeat"]).any()
    row = df[(df.request_id == good.request_id[0]) & (df.repeat == good.repeat[0])]
    assert list(row.output_tokens.iloc[0]) == list(good.output_tokens[0])  # the same tokens


def test_plots_render_what_is_valid_beside_a_corrupt_row(tmp_path, capsys):
    from experiments.plots import cli

    cfg = smoke_cfg(tmp_path / "res")
    runner.run(cfg, log=lambda *_: None)
    CORRUPTIONS["truncated"](_rows(tmp_path / "res")[0])
    assert cli.main([str(tmp_path / "res"), "--out", str(tmp_path / "fig")]) == 0
    assert "skipped 1 unreadable" in capsys.readouterr().err


def test_a_killed_writers_temp_files_are_removed_when_the_case_runs_again(tmp_path):
    cfg = smoke_cfg(tmp_path, workload={"items": 1, "repeats": 1})
    runner.run(cfg, log=lambda *_: None)
    case_dir = _rows(tmp_path)[0].parent
    dead = case_dir / f".tmp-{os.uname().nodename}-999999999-abc.parquet"  # no such process
    old = case_dir / ".tmp-othermachine-1-abc.parquet"
    live = case_dir / f".tmp-{os.uname().nodename}-{os.getpid()}-abc.parquet"  # this process
    for p in (dead, old, live):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * records.STALE_TMP_S,) * 2)
    runner.run(cfg, log=lambda *_: None)
    assert not dead.exists() and not old.exists() and live.exists()
    assert len(records.load(tmp_path)) == 1


# -- Ctrl-C and kill -9 ---------------------------------------------------------------------
# Every row decodes its 48 tokens (no stop at EOS): how long the run lasts after its first row
# must not depend on when the trained model happens to emit its EOS.
LONG_RUN = ["model=tiny_deepseek", "system=resident", "hardware=cpu", "dataset=gsm8k",
            "workload.items=3", "workload.repeats=20", "workload.max_new_tokens=48",
            "workload.stop_on_eos=false", "progress=false"]


def _as_from_a_terminal():
    """In the child before exec: Ctrl-C's default disposition, unblocked, as a shell gives a
    command. A child inherits ignored and blocked signals, and the suite's own process may
    have SIGINT ignored or blocked by then (loky's resource tracker, started by the joblib
    launcher tests, blocks it while it spawns): the run would then never see the Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_and_signal(tmp_path, sig):
    """Start a 60-row run, send `sig` once its first row is on disk; (returncode, stderr)."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.Popen([sys.executable, str(REPO / "run.py"), *LONG_RUN,
                             f"out_dir={tmp_path}"], cwd=REPO, preexec_fn=_as_from_a_terminal,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    deadline = t0 + 120
    while not _rows(tmp_path) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    seen = f"{len(_rows(tmp_path))} row(s) on disk after {time.time() - t0:.1f} s"
    ended = proc.poll()  # a run that ended before the signal was sent: say so
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    if ended is not None:
        err = (f"[the run had ended (exit {ended}) before the signal: {seen}]\n{err}\n"
               f"{out[-1500:]}")
    return proc.returncode, err


@pytest.mark.slow
def test_kill_9_keeps_whole_rows_and_the_rerun_writes_each_missing_row_once(tmp_path):
    import signal

    from conftest import run_cli

    code, _ = _start_and_signal(tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL
    kept = len(records.load(tmp_path))  # every file on disk reads back
    again = run_cli(*LONG_RUN, f"out_dir={tmp_path}")
    assert again.returncode == 0 and f"resuming: {kept} of 60 rows" in again.stdout
    df = records.load(tmp_path)
    assert len(df) == 60 and not df.duplicated(["request_id", "repeat"]).any()
    assert not list(tmp_path.glob("records/*/.tmp-*"))  # the dead writer's temp file is gone


@pytest.mark.slow
def test_ctrl_c_is_one_line_exit_130_and_the_rerun_resumes(tmp_path):
    import signal

    from conftest import run_cli

    args = [*LONG_RUN, f"out_dir={tmp_path}"]
    code, err = _start_and_signal(tmp_path, signal.SIGINT)
    assert code == 130, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: ") and "resume" in lines[0]
    kept = len(records.load(tmp_path))
    assert kept >= 1 and not list(tmp_path.glob("records/*/.tmp-*"))  # whole rows only
    again = run_cli(*args)
    assert again.returncode == 0 and f"resuming: {kept} of 60 rows" in again.stdout
    assert len(records.load(tmp_path)) == 60


# -- bad settings on the command line: one sentence, exit 2, nothing written ---------------
BAD_SETTINGS = [
    (("workload.itemz=3",), "unknown setting 'workload.itemz'; did you mean 'workload.items'?"),
    (("outdir=x",), "unknown setting 'outdir'; did you mean 'out_dir'?"),
    (("foo.bar=1",), "'foo' is not a config section"),
    (("hardware.h2d_bandwith_Bps=1",), "did you mean 'hardware.h2d_bandwidth_Bps'?"),
    (("out_dir=~/x",), "cannot read the setting 'out_dir=~/x': quote a value"),
    (("out_dir=",), "out_dir is empty"),
    (("model=tiny_gpt",), "unknown model 'tiny_gpt'"),
    (("system=lru", "system.top_m=3"), "system.top_m applies to"),
    (("system=lru", "system.sharing=1"), "unknown setting 'system.sharing'"),
    (("spec.k=0",), "spec.k (the draft depth K) must be at least 1"),
    (("workload.items=abc",), "workload.items must be int"),
    (("offload.policy=fifo",), "unknown offload.policy 'fifo'; choose one of: lfu, lru."),
]


def _cli_error(args: tuple[str, ...]) -> str:
    """What `python run.py ARGS` refuses, checked in this process the way run.py does it:
    its argument checks, Hydra's composition, the typed RunConfig, then the composition
    root's first step (compose.settle: no file read)."""
    from specter import compose
    from specter.settings import run_config
    from specter.errors import UserError

    try:
        compose.settle(run_config(list(args)), log=lambda *a: None)
    except UserError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("args,text", BAD_SETTINGS, ids=[" ".join(a) for a, _ in BAD_SETTINGS])
def test_a_bad_setting_is_one_sentence(args, text):
    message = _cli_error(("model=tiny_deepseek", "hardware=cpu", *args))
    assert text in message and "\n" not in message


@pytest.mark.parametrize("args,text", [BAD_SETTINGS[0], BAD_SETTINGS[4]])
def test_the_command_line_prints_it_on_one_line_with_exit_2(tmp_path, args, text):
    from conftest import run_cli

    out = tmp_path / "out"
    res = run_cli("model=tiny_deepseek", "hardware=cpu", *args, f"out_dir={out}")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], res.stderr
    assert not out.exists()


def test_every_typed_setting_works_in_the_plain_key_value_form():
    """`workload.temperature=0.7` (docs/draft.md's form) although workload=artifact does not list it."""
    from conftest import run_cli

    res = run_cli("workload.temperature=0.7", "offload.policy=lfu", "--cfg", "job")
    assert res.returncode == 0, res.stderr
    assert "temperature: 0.7" in res.stdout and "policy: lfu" in res.stdout


def test_a_command_line_sweep_replaces_the_overlays_sweep_of_the_same_key():
    """`experiment=depth spec.k=2,4` sweeps K over 2 and 4 only: a key the yaml lists stays
    plain, so Hydra's sweeper sees one `spec.k` (with `++spec.k` it would also run the
    overlay's nine K, each overridden back to the command line's)."""
    from specter.settings import typed_overrides

    out = typed_overrides(["-m", "experiment=batch", "workload.batch=1,32", "spec.k=2,4",
                           "workload.temperature=0.5"])
    assert out == ["-m", "experiment=batch", "workload.batch=1,32", "spec.k=2,4",
                   "++workload.temperature=0.5"]


# -- checked before any weights load: one sentence, nothing written -----------------------


def _hw(name: str) -> dict:
    from omegaconf import OmegaConf

    from conftest import REPO

    return OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "hardware" / f"{name}.yaml"))


PREFLIGHT = [
    ({"workload": {"prompt_tokens": 1000, "max_new_tokens": 100}, "system": {"name": "specter"}},
     "a speculative window of 5 = 1105 positions exceed model=tiny_deepseek's 1024"),
    ({"system": {"name": "specter", "top_m": 100}}, "system.top_m (100) exceeds"),
    ({"system": {"name": "lru_s"}, "quant": {"backend": "triton"}},
     "quant.backend=triton needs a CUDA device"),
    ({"system": {"name": "specter"}, "quant": {"graphs": "on"}},
     "quant.graphs=on replays CUDA graphs, and this run is on cpu"),
    ({"model": {"name": "tiny_olmoe", "source": "project", "budget_slots": {"high": 16}},
      "hardware_charge": "real", "system": {"name": "lru"}},
     "hardware.charge=real needs a model that stands for a real one"),
    ({"system": {"name": "lru"}, "hardware_name": "cpu"}, "system=lru: offloading on the CPU needs a modelled link"),
    ({"out_dir_file": True}, "is a file, not a folder"),
    ({"cache_dir": "/proc/no/such"}, "cache_dir=/proc/no/such cannot be written"),
]


@pytest.mark.parametrize("over,text", PREFLIGHT, ids=[t[:40] for _, t in PREFLIGHT])
def test_checked_before_the_model_loads(tmp_path, monkeypatch, over, text):
    from specter.errors import UserError
    from specter.placement import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    monkeypatch.setattr(compose, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    over = dict(over)
    hw = _hw(over.pop("hardware_name", "a100_pcie4_hf"))
    if "hardware_charge" in over:
        hw["charge"] = over.pop("hardware_charge")
    out = tmp_path / "out"
    if over.pop("out_dir_file", False):
        out.write_text("a file")
    cfg = smoke_cfg(out, hardware=hw, **over)
    with pytest.raises(UserError, match=text.replace("(", r"\(").replace(")", r"\)")):
        runner.run(cfg, log=lambda *_: None)
    assert not list(out.glob("records")) if out.is_dir() else True


def test_a_model_without_a_real_counterpart_runs_with_its_own_sizes(tmp_path):
    """hardware.charge=auto (the profiles' default): the real model's sizes where the project
    model stands for one, its own otherwise; the record says which."""
    cfg = smoke_cfg(tmp_path, hardware=_hw("a100_pcie4_hf"), system={"name": "lru"},
                    model={"name": "tiny_olmoe", "source": "project", "budget_slots": {"high": 16}},
                    workload={"items": 1, "repeats": 1})
    runner.run(cfg, log=lambda *_: None)
    assert records.load(tmp_path)["charged.source"].iloc[0] == "own:tiny_olmoe"


# -- a bad checkpoint folder (model.path=DIR): one sentence naming the file ----------------
def _break_config(text):
    return lambda d: (d / "config.json").write_text(text)


def _edit_config(**changes):
    def edit(d):
        import json

        raw = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                raw.pop(k, None)
            else:
                raw[k] = v
        (d / "config.json").write_text(json.dumps(raw))
    return edit


def _truncate_weights(d):
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-1000])


BAD_CHECKPOINTS = {
    "malformed config.json": (_break_config("{not json"), "config.json is not valid JSON"),
    "no model_type": (_edit_config(model_type=None), "names no model_type"),
    "unknown model_type": (_edit_config(model_type="gpt9"), "model_type 'gpt9' is not an architecture"),
    "auto_map of an unknown architecture": (
        _edit_config(model_type="gpt9", auto_map={"AutoConfig": "x.Y"}),
        "ships its own code \\(auto_map\\)"),
    "no routed-expert count": (_edit_config(n_routed_experts=None),
                               "names no routed-expert count"),
    "truncated safetensors": (_truncate_weights, "is truncated"),
}


@pytest.mark.parametrize("how", list(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_folder_is_one_sentence(tmp_path, monkeypatch, tiny_models, how):
    import shutil

    from specter.errors import UserError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_models("tiny_deepseek").checkpoint, ckpt)
    breaker, text = BAD_CHECKPOINTS[how]
    breaker(ckpt)
    monkeypatch.setattr(compose, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    cfg = smoke_cfg(tmp_path / "out", model={"name": "deepseek", "source": "hf",
                                              "path": str(ckpt), "stands_for": None})
    with pytest.raises(UserError, match=text) as err:
        runner.run(cfg, log=lambda *_: None)
    assert "\n" not in str(err.value)


def test_a_disk_that_fills_mid_run_is_one_sentence_and_keeps_the_rows(tmp_path, monkeypatch):
    import errno

    from specter.errors import UserError

    real = records.pq.write_table
    calls = {"n": 0}

    def fill_up(table, where, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(table, where, *a, **k)

    monkeypatch.setattr(records.pq, "write_table", fill_up)
    cfg = smoke_cfg(tmp_path)
    with pytest.raises(UserError, match="stopped taking rows .No space left on device.; the 2 row"):
        runner.run(cfg, log=lambda *_: None)
    assert len(records.load(tmp_path)) == 2 and not list(tmp_path.glob("records/*/.tmp-*"))
    monkeypatch.setattr(records.pq, "write_table", real)
    assert runner.run(cfg, log=lambda *_: None).written == 2  # the rerun resumes


# -- a broken prompt file, a pickle-only checkpoint ---------------------------------------
BAD_DATA = {
    "not json": ("hello\n", 'gsm8k.jsonl:1 is not a JSON object with a "text" string'),
    "no text key": ('{"question": "x"}\n', "gsm8k.jsonl:1 is not a JSON object"),
    "text not a string": ('{"text": 3}\n', "its text is a int, not a string"),
    "not utf-8": (b"\xff\xfe\x00garbage", "is not UTF-8 text"),
}


@pytest.mark.parametrize("how", list(BAD_DATA))
def test_a_broken_prompt_file_is_one_sentence_naming_it(tmp_path, monkeypatch, how):
    from specter.errors import UserError

    content, text = BAD_DATA[how]
    data = tmp_path / "data"
    data.mkdir()
    target = data / "gsm8k.jsonl"
    target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content)
    monkeypatch.setattr(compose, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    with pytest.raises(UserError, match=text):
        runner.run(smoke_cfg(tmp_path / "out", data_dir=str(data)), log=lambda *_: None)


class _Trap:
    """Unpickling this touches a marker file: the test fails if anything unpickles it."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_only_checkpoint_is_refused_and_never_unpickled(tmp_path, tiny_models):
    import pickle
    import shutil

    from specter.errors import UserError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_models("tiny_deepseek").checkpoint, ckpt)
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    trap = _Trap()
    trap.marker = str(tmp_path / "UNPICKLED")
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(trap))
    cfg = smoke_cfg(tmp_path / "out", model={"name": "deepseek", "source": "hf",
                                              "path": str(ckpt), "stands_for": None})
    with pytest.raises(UserError, match="holds no .safetensors weights"):
        runner.run(cfg, log=lambda *_: None)
    assert not (tmp_path / "UNPICKLED").exists()
