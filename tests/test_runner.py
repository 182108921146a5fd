"""The runner end to end: records written, resumable sweeps, and bad input as one sentence."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import run_cli
from experiments import records, runner
from specter import compose
from specter.config import RunConfig
from specter.errors import UserError

REQUIRED = ["run_id", "system", "model", "budget", "dataset", "hardware", "request_id", "repeat",
            "prompt_tokens", "output_tokens", "tpot_ms", "ttft_ms", "tokens_per_s",
            "peak_mem_bytes", "prov.git_commit", "prov.pkg.torch", "prov.machine", "seed",
            "cfg.model.name", "cfg.workload.max_new_tokens", "dataset_standin"]


def smoke_cfg(out_dir, **over) -> RunConfig:
    d = {"model": {"name": "tiny_deepseek", "source": "project", "budget_slots": {"high": 16}},
         # eager: the runner's mechanics, not the compiled step (tests/test_compiled_decode.py)
         "budget": {"name": "high"}, "system": {"name": "resident", "compile": "off"},
         "dataset": {"name": "gsm8k"}, "hardware": {"name": "cpu", "device": "cpu"},
         "workload": {"items": 2, "max_new_tokens": 6, "repeats": 2},
         "out_dir": str(out_dir), "progress": False}
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    if d["system"]["name"] != "resident":  # the knob is resident's
        d["system"].pop("compile", None)
    return RunConfig.from_dict(d)


@pytest.mark.slow
def test_cli_smoke_writes_records_then_resumes(tmp_path):
    out = tmp_path / "res"
    # no stop at EOS: every row has its 16 tokens whenever the trained model emits its EOS
    first = run_cli("experiment=smoke", f"out_dir={out}", "progress=false",
                    "workload.stop_on_eos=false")
    assert first.returncode == 0, first.stderr
    assert "device byte accounting" in first.stdout and "RESULT" in first.stdout
    df = records.load(out)
    assert len(df) == 2  # 2 prompts x 1 repeat
    assert set(REQUIRED) <= set(df.columns)
    assert (df["model"] == "tiny_deepseek").all() and (df["system"] == "resident").all()
    assert df["prompt_tokens"].map(len).max() <= 16
    assert (df["output_tokens"].map(len) == 16).all()
    assert (df["tpot_ms"] > 0).all() and (df["peak_mem_bytes"] > 0).all()
    # hardware=auto without a GPU: the virtual clock of the fallback GPU profile, said once.
    assert "no GPU here" in first.stdout
    assert (df["hardware"] == "a100_pcie4_hf").all() and (df["clock"] == "virtual").all()
    assert (df["engine"] == "hf").all()
    again = run_cli("experiment=smoke", f"out_dir={out}", "progress=false",
                    "workload.stop_on_eos=false")
    assert again.returncode == 0, again.stderr
    assert "skipped 2" in again.stdout
    assert len(records.load(out)) == 2


def test_interrupted_sweep_resumes_each_row_once(tmp_path, monkeypatch):
    from specter.decoding import engines

    cfg = smoke_cfg(tmp_path)
    real = engines.GreedyEngine.generate
    calls = {"n": 0}

    def crash_on_third(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the machine goes away mid-sweep
        return real(self, *a, **k)

    monkeypatch.setattr(engines.GreedyEngine, "generate", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg, log=lambda *_: None)
    assert len(records.load(tmp_path)) == 2
    monkeypatch.setattr(engines.GreedyEngine, "generate", real)
    summary = runner.run(cfg, log=lambda *_: None)
    assert (summary.written, summary.skipped) == (2, 2)
    df = records.load(tmp_path)
    assert len(df) == 4
    assert not df.duplicated(["request_id", "repeat"]).any()
    # Repeats of one prompt decode the same tokens.
    for _, g in df.groupby("request_id"):
        assert len({tuple(t) for t in g["output_tokens"]}) == 1


def test_different_cases_share_a_tree_without_clashes(tmp_path):
    runner.run(smoke_cfg(tmp_path), log=lambda *_: None)
    runner.run(smoke_cfg(tmp_path, dataset={"name": "humaneval"}), log=lambda *_: None)
    df = records.load(tmp_path)
    assert len(df) == 8 and df["case_id"].nunique() == 2
    assert set(df["dataset"]) == {"gsm8k", "humaneval"}
    assert df.loc[df["dataset"] == "humaneval", "dataset_standin"].eq(False).all()


BAD = [
    (["model=gpt5"], "unknown model 'gpt5'"),
    (["system=magic"], "unknown system 'magic'"),
    (["dataset=imagenet"], "unknown dataset 'imagenet'"),
    (["model=deepseek", "model.path=/nonexistent/ds"], "no checkpoint for model=deepseek"),
    (["dataset=custom", "dataset.prompts=['   ']"], "empty prompt"),
    (["budget.slots=3"], "below top-k=6"),
    (["budget.slots=65"], "exceeds the 64 routed experts"),
    (["workload.max_new_tokens=0"], "workload.max_new_tokens must be at least 1"),
    (["workload.batch=0"], "workload.batch must be at least 1"),
    (["system=fidelity", "workload.batch=2"], "decodes one request at a time"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_sentence_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "res"
    proc = run_cli("experiment=smoke", f"out_dir={out}", "progress=false", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert records.row_files(out) == []


def test_unknown_config_key_is_named():
    with pytest.raises(UserError, match="unknown config key.*workload.itemz"):
        RunConfig.from_dict({**smoke_cfg("x").to_dict(), "workload": {"itemz": 3}})


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    out = tmp_path / "sweep"
    proc = run_cli("-m", "experiment=smoke", f"out_dir={out}", "progress=false",
                   "dataset=gsm8k,c4", "workload.max_new_tokens=4")
    assert proc.returncode == 0, proc.stderr
    df = records.load(out)
    assert sorted(df["dataset"].unique()) == ["c4", "gsm8k"] and len(df) == 4
    assert isinstance(df, pd.DataFrame)


def test_real_model_path_loads_a_local_checkpoint(tmp_path, tiny_models):
    """`model=deepseek model.path=DIR` goes through the real-checkpoint path (safetensors, no
    remote code); a DeepSeek-V2 architecture folder made by the project stands in for it."""
    ckpt = tiny_models("tiny_deepseek").checkpoint
    out = tmp_path / "res"
    proc = run_cli("experiment=smoke", "model=deepseek", f"model.path={ckpt}", f"out_dir={out}",
                   "progress=false", "workload.max_new_tokens=4")
    assert proc.returncode == 0, proc.stderr
    df = records.load(out)
    assert len(df) == 2 and (df["model"] == "deepseek").all()
    assert (df["checkpoint"] == str(ckpt)).all()


def test_spec_settings_are_part_of_the_case_only_for_speculative_systems():
    """A sweep over spec.k runs lru once (its case has no K, its rows claim none); lru_s once
    per K."""
    def case(system, k):
        d = smoke_cfg("x").to_dict()
        d["system"] = {"name": system}
        d["spec"] = {**d["spec"], "k": k}
        return runner.case_of(RunConfig.from_dict(d), 4)

    assert case("lru", 4) == case("lru", 8) and "spec" not in case("lru", 4)
    assert case("lru_s", 4) != case("lru_s", 8) and case("lru_s", 4)["spec"]["k"] == 4


def test_grouped_experts_at_auto_keep_the_case_of_runs_before_the_knob():
    """offload.grouped=auto changes no timeline (tests/test_grouped.py): its case is the one
    recorded before the knob, so earlier results resume; false is a case of its own."""
    def case(grouped):
        d = smoke_cfg("x").to_dict()
        d["system"] = {"name": "lru"}
        d["offload"] = {**d["offload"], "grouped": grouped}
        return runner.case_of(RunConfig.from_dict(d), 4)

    assert case("auto")["offload"] == {"policy": "lru"}
    assert case(False)["offload"] == {"policy": "lru", "grouped": False}


def test_verify_pieces_at_auto_keep_the_case_where_no_floor_is_charged():
    """offload.verify_pieces=auto verifies eagerly on a virtual clock without a kernel floor:
    the case of runs before the knob; off, or auto under a floor, is a case of its own."""
    def case(setting, floor=0.0):
        d = smoke_cfg("x").to_dict()
        d["offload"] = {**d["offload"], "verify_pieces": setting}
        d["hardware"] = {**d["hardware"], "kernel_floor_s": floor}
        return runner.case_of(RunConfig.from_dict(d), 4)

    assert "verify_pieces" not in case("auto")["offload"]
    assert case("off")["offload"]["verify_pieces"] == "off"
    assert case("auto", 4e-6)["offload"]["verify_pieces"] == "auto"


def test_auto_hardware_keeps_real_clocks_where_asked(tmp_path):
    import torch

    cfg = smoke_cfg(tmp_path, hardware={"name": "auto", "device": "auto", "cpu_fallback": "h200_ideal"})
    moved = compose.resolve_auto_hardware(cfg, torch.device("cpu"), log=lambda *_: None)
    assert (moved.hardware.name, moved.hardware.clock, moved.hardware.engine) == ("h200_ideal", "virtual", "ideal")
    assert moved.hardware.device == "cpu"
    for keep in (smoke_cfg(tmp_path),  # hardware=cpu: this CPU's wall clock
                 smoke_cfg(tmp_path, hardware={"name": "auto", "cpu_fallback": "h200_ideal"},
                           system={"name": "fidelity"})):
        assert compose.resolve_auto_hardware(keep, torch.device("cpu")).hardware == keep.hardware
    on_gpu = compose.resolve_auto_hardware(cfg, torch.device("cuda"))
    assert on_gpu.hardware.clock == "wall"
    with pytest.raises(UserError, match="unknown hardware profile 'nope'"):
        compose.load_hardware("nope")


def test_batched_run_writes_a_row_per_sequence_and_resumes_a_partial_batch(tmp_path):
    cfg = smoke_cfg(tmp_path, workload={"items": 3, "batch": 2, "repeats": 1})
    runner.run(cfg, log=lambda *_: None)
    df = records.load(tmp_path).sort_values("request_id")
    assert len(df) == 3 and df["batch_id"].tolist() == ["r0-000", "r0-000", "r0-002"]
    assert df["batch_size"].tolist() == [2, 2, 1]
    first = df[df["batch_id"] == "r0-000"]
    assert first["batch_tokens"].iloc[0] == first["n_output_tokens"].sum()
    assert first["batch_tokens_per_s"].nunique() == 1 and (first["batch_tokens_per_s"] > 0).all()
    alone = runner.run(smoke_cfg(tmp_path / "one", workload={"items": 3, "repeats": 1}),
                       log=lambda *_: None)
    one = records.load(alone.out_dir).sort_values("request_id")
    assert one["output_tokens"].map(tuple).tolist() == df["output_tokens"].map(tuple).tolist()
    # A crash after one row of a batch: the rerun decodes the batch and writes the other row.
    next(p for p in records.row_files(tmp_path) if "gsm8k-001" in p.name).unlink()
    summary = runner.run(cfg, log=lambda *_: None)
    assert (summary.written, summary.skipped) == (1, 2)
    again = records.load(tmp_path).sort_values("request_id")
    assert again["output_tokens"].map(tuple).tolist() == df["output_tokens"].map(tuple).tolist()


def test_on_a_gpu_every_engine_is_warmed_before_its_timed_rows():
    """A real clock on CUDA warms every system with one untimed request (the H200's LRU paid
    216 ms a token in its first timed request, 99 in its second); on the CPU only a compiled
    step is warmed; a virtual clock never."""
    import torch

    from specter.settings import run_config
    from specter.compose import warm_up

    class Engine:
        compiled: dict = {}

        def __init__(self, device):
            self.device, self.calls = torch.device(device), 0

        def reset(self):
            pass

        def generate(self, prompt, n):
            self.calls += 1

    wall = run_config(["model=tiny_deepseek", "hardware=cpu", "system=resident"])
    virtual = run_config(["model=tiny_deepseek", "hardware=a100_pcie4_hf", "system=resident"])
    gpu, cpu, charged = Engine("cuda"), Engine("cpu"), Engine("cuda")
    warm_up(gpu, wall, [1, 2], log=lambda *_: None)
    warm_up(cpu, wall, [1, 2], log=lambda *_: None)
    warm_up(charged, virtual, [1, 2], log=lambda *_: None)
    assert (gpu.calls, cpu.calls, charged.calls) == (1, 0, 0)
