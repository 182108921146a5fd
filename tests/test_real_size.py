"""The real-size stage (scripts/real_size.sh, run by scripts/gpu_check.sh stage `real_size`) on
the rows the runner writes: its verdict (experiments/real_size.py) pairs a CUDA run's rows
(clock "cuda", from the CUDA link's own code over a stand-in for torch.cuda) with the virtual
clock's; each job in one process is freed before the next loads; the script's GPU command
line passes the run's own checks; and its whole chain runs on the CPU end to end."""

from __future__ import annotations

import dataclasses
import gc
import os
import shlex
import subprocess
import sys
import weakref

import pandas as pd
import pytest
import torch
from torch import nn

from conftest import REPO
from experiments import real_size, records, runner
from specter import compose
from fake_cuda import FakeCuda
from specter.config import RunConfig
from specter.decoding import engines
from specter.clock.timing import Timing
from specter.offload.link import CudaLink, LinkProfile

CPU = torch.device("cpu")
GiB = 2**30
# A GPU run's rows say hardware "cuda" (conf/hardware/cuda.yaml): here a profile of that name
# with a device profile's rates, so that the CPU's preflight accepts an offloading system; its
# time comes from the CUDA link patched in below, not from these rates.
CUDA_NAMED = {"name": "cuda", "device": "cpu", "clock": "virtual", "charge": "own",
              "matrix_flops": 312e12, "mem_bandwidth_Bps": 1.555e12, "launch_overhead_s": 5e-6,
              "h2d_bandwidth_Bps": 25e9, "h2d_latency_s": 1e-5,
              "host_matrix_flops": 2e12, "host_mem_bandwidth_Bps": 100e9}


def _cfg(system: str, hardware: dict, out_dir, **over) -> RunConfig:
    d = {"model": {"name": "tiny_deepseek", "source": "project", "stands_for": "deepseek"},
         "budget": {"name": "gb", "gb": 24}, "system": {"name": system},
         "dataset": {"name": "gsm8k"}, "hardware": hardware, "quant": {"method": "rtn"},
         "workload": {"items": 1, "max_new_tokens": 6, "repeats": 1, "stop_on_eos": False},
         "out_dir": str(out_dir), "progress": False, **over}
    return RunConfig.from_dict(d)


def _on_cuda_link(monkeypatch) -> None:
    """Every engine built from now on times itself through the CUDA link's code (its copy
    stream, its events) over the stand-in: clock "cuda", as on a GPU."""
    monkeypatch.setattr(engines, "timing_for", lambda ctx: Timing(
        link=CudaLink(LinkProfile(25e9, 1e-5), CPU, cuda=FakeCuda()), cost=None, clock="cuda"))


def _h200_measured() -> dict:
    return dataclasses.asdict(compose.load_hardware("h200_measured"))


def test_the_verdict_pairs_a_cuda_runs_rows_with_the_virtual_clocks(tmp_path, monkeypatch):
    quiet = lambda *_: None  # noqa: E731
    with monkeypatch.context() as m:
        _on_cuda_link(m)
        for system in ("lru", "specter"):
            runner.run(_cfg(system, CUDA_NAMED, tmp_path), log=quiet)
    for system in ("lru", "specter"):  # unpatched: the measured profile's virtual clock
        runner.run(_cfg(system, _h200_measured(), tmp_path), log=quiet)
    df = records.load(tmp_path)
    assert len(df) == 4
    real = df[df["hardware"] == "cuda"]
    assert set(real["clock"]) == {"cuda"}  # the link's clock, not the config's "virtual"
    assert set(df[df["hardware"] == "h200_measured"]["clock"]) == {"virtual"}

    t = real_size.error_table(df, "h200_measured").set_index("system")  # real: real clocks
    assert set(t.index) == {"lru", "specter"}
    assert (t["budget_key"] == "24 GiB").all() and (t["real_clock"] == "cuda").all()
    assert (t["real_hardware"] == "cuda").all() and (t["virtual_hardware"] == "h200_measured").all()
    assert (t["real_rows"] == 1).all() and (t["virtual_rows"] == 1).all()
    for system in ("lru", "specter"):
        rows = df[df["system"] == system].set_index("hardware")["tpot_ms"]
        assert t.loc[system, "real_ms"] == rows["cuda"] > 0
        assert t.loc[system, "virtual_ms"] == rows["h200_measured"] > 0
        assert t.loc[system, "virtual_over_real"] == pytest.approx(rows["h200_measured"] / rows["cuda"])
    # another virtual profile's rows are not the virtual side
    assert real_size.error_table(df, virtual_hardware="a100_pcie4_hf")["virtual_ms"].isna().all()

    p = real_size.peaks(df)
    assert len(p) == 4 and p["fits"].all()
    assert set(zip(p["hardware"], p["clock"])) == {("cuda", "cuda"), ("h200_measured", "virtual")}
    assert (p["source"] == "device_tensors").all() and (p["load_peak_gib"] > 0).all()
    assert real_size.main([str(tmp_path), "--csv", str(tmp_path / "t.csv"),
                           "--virtual-hardware", "h200_measured"]) == 0
    assert (tmp_path / "t.csv").is_file()
    # a load-time peak above its budget fails the check
    over = df.assign(load_peak_device_bytes=df["load_peak_device_bytes"].where(
        df["system"] != "specter", 25 * GiB))
    assert dict(zip(real_size.peaks(over)["system"], real_size.peaks(over)["fits"])) == \
        {"lru": True, "specter": False}


def test_a_job_is_freed_before_the_next_one_loads(tmp_path, monkeypatch):
    """Two jobs in one process, as a Hydra sweep runs them: once the first `run` returns,
    nothing of its model, engine or slot buffers is alive (on CUDA their blocks would count in
    the next job's load-time peak), with the automatic collector off so that only the runner's
    own freeing counts. Without it (compose.free a no-op) they would still be alive."""
    alive: list[weakref.ref] = []
    real_load, real_build = compose.load_model, compose.build_engine

    def load(*a, **k):
        loaded = real_load(*a, **k)
        alive.append(weakref.ref(loaded.model))
        return loaded

    def build(ctx, *args):
        engine = real_build(ctx, *args)
        alive.append(weakref.ref(engine))
        alive.extend(weakref.ref(lc.buf) for lc in engine.runtime.cache.layers)
        return engine

    monkeypatch.setattr(compose, "load_model", load)
    monkeypatch.setattr(compose, "build_engine", build)
    quiet = lambda *_: None  # noqa: E731
    hw = _h200_measured()

    def first_job(system: str, out) -> tuple[int, list[str]]:
        """(objects watched, the types of those still alive once `run` returned), read
        before the collector is back on (its next allocation would collect)."""
        alive.clear()
        gc.collect()
        gc.disable()
        try:
            runner.run(_cfg(system, hw, out), log=quiet)
            return len(alive), [type(r()).__name__ for r in alive if r() is not None]
        finally:
            gc.enable()

    for system in ("lru", "specter"):
        watched, held = first_job(system, tmp_path / system)
        assert watched >= 4 and held == [], f"{system}: the last job is alive: {held}"
        runner.run(_cfg("lru", CUDA_NAMED | {"name": "a100"}, tmp_path / system), log=quiet)
        assert len(records.load(tmp_path / system)) == 2

    with monkeypatch.context() as m:  # the control: the freeing is what frees them (their
        m.setattr(compose, "free", lambda error=None: None)  # hooks make cycles)
        _, held = first_job("specter", tmp_path / "control")
        assert "DeepseekV2ForCausalLM" in held
    gc.collect()

    # a job that fails mid-run is freed too: its traceback no longer holds its frames
    def crash(self, *a, **k):
        raise RuntimeError("the machine went away")

    monkeypatch.setattr(engines.GreedyEngine, "generate", crash)
    alive.clear()
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="went away") as failed:
            runner.run(_cfg("lru", hw, tmp_path / "crash"), log=quiet)
        held = [type(r()).__name__ for r in alive if r() is not None]
    finally:
        gc.enable()
    assert failed.value.__traceback__ is not None and alive and held == []


def test_random_experts_are_named_by_their_seed_not_hashed(monkeypatch):
    """The draft's source checksum of a random store comes from what determines its values
    (DeepSeek-V2-Lite's 27 GiB would take tens of seconds to hash on one core)."""
    from specter.placement import loader as host_load
    from specter.offload.store import STORE_ATTR, ExpertLayout
    from specter.quant import calibrate

    monkeypatch.setattr(host_load, "_LAST_RANDOM_STORE", {})
    layout = ExpertLayout(num_experts=2, inter=4, hidden=8, dtype=torch.float32)
    from types import SimpleNamespace

    def maker(seed):
        return host_load._RandomMaker(SimpleNamespace(initializer_range=0.02),
                                      torch.device("cpu"), seed)

    key = ("{config}", "torch.float32", 0, False, 0.02)
    store = host_load._made_store(key, [1, 2], layout, False, maker(0))
    assert store.checksum.startswith("random-")
    assert host_load._made_store(key, [1, 2], layout, False, maker(0)) is store  # reused
    other = host_load._made_store(key[:2] + (1,) + key[3:], [1, 2], layout, False, maker(1))
    assert other.checksum != store.checksum
    pinned = host_load._made_store(key[:3] + (True,) + key[4:], [1, 2], layout, False, maker(1))
    assert pinned.checksum == host_load.random_checksum(key)  # pinning leaves the values

    def no_hashing(*_):
        raise AssertionError("hashed the store's bytes")

    monkeypatch.setattr(calibrate, "weights_checksum_parts", no_hashing)
    model = nn.Module()
    setattr(model, STORE_ATTR, store)
    assert calibrate.source_checksum(model) == store.checksum


def _script(env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "real_size.sh")], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                          capture_output=True, text=True, timeout=timeout)


def test_the_gpu_command_line_passes_the_runs_own_checks(tmp_path):
    """The stage's GPU defaults, as the script issues them (python replaced by a stub that logs
    its arguments): one sweep of lru and specter, real CUDA time and h200_realsize, at
    budget.gb=24 with an RTN draft, 2 items x 24 tokens, no resident job; then the verdict with
    both sides named. Every override passes run.py's checks of group choices, system knobs and
    typed keys (what fails a GPU run in its first second)."""
    log = tmp_path / "argv.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {shlex.quote(str(log))}\n'
                    f'echo >> {shlex.quote(str(log))}\n')
    stub.chmod(0o755)
    done = _script({"PY": str(stub), "OUT": str(tmp_path / "out"), "H2D_GBPS": "50"}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert [c[:2] for c in calls] == [["run.py", "-m"], ["-m", "experiments.real_size"]]
    sweep = calls[0][2:]
    for arg in ("model=deepseek", "model.weights=random", "system=lru,specter",
                "hardware=cuda,h200_realsize", "budget=gb", "budget.gb=24", "quant.method=rtn",
                "workload.items=2", "workload.max_new_tokens=24", "workload.repeats=1",
                "progress=false", f"out_dir={tmp_path / 'out' / 'records'}"):
        assert arg in sweep, arg
    assert calls[1][2:] == [str(tmp_path / "out" / "records"), "--csv",
                            str(tmp_path / "out" / "error_table.csv"), "--real-hardware", "cuda",
                            "--virtual-hardware", "h200_realsize", "--h2d-gbps", "50"]
    from specter.settings import checked_overrides

    assert len(checked_overrides(sweep)) == len(sweep)
    gpu_check = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert "scripts/real_size.sh" in gpu_check and 'REAL_SIZE_TIMEOUT_S:-300' in gpu_check


@pytest.mark.slow
def test_the_stage_chain_runs_end_to_end_on_the_cpu(tmp_path):
    """The stage's exact chain on a tiny project-made model (its own weights, not random ones).
    The CPU has no CUDA clock, and an offloading system on the CPU's wall clock is refused, so
    a virtual profile (a100_pcie4_hf) stands in for the real side; the virtual side is the
    GPU's own, h200_measured. The records read back into a non-empty error table and peaks
    table, and the verdict passes."""
    out = tmp_path / "rs"
    done = _script({"MODEL": "tiny_deepseek", "WEIGHTS": "checkpoint", "REAL_HW": "a100_pcie4_hf",
                    "VIRTUAL_HW": "h200_measured", "OUT": str(out), "PY": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "-- verdict" in done.stdout
    df = records.load(out / "records")
    assert len(df) == 8  # lru, specter x two profiles x 2 items
    assert set(df["budget_gb"]) == {24.0} and set(df["weights"]) == {"checkpoint"}
    t = real_size.error_table(df, "h200_measured", real_hardware="a100_pcie4_hf")
    assert set(t["system"]) == {"lru", "specter"}
    assert t[["real_ms", "virtual_ms"]].notna().all().all() and (t["real_rows"] == 2).all()
    assert (t["real_clock"] == "virtual").all()  # the stand-in says what it is
    p = real_size.peaks(df)
    assert len(p) == 4 and p["fits"].all()
    assert (out / "error_table.csv").is_file()


NARROW = ("model.narrow={hidden_size:96,moe_intermediate_size:48,intermediate_size:160,"
          "kv_lora_rank:48,num_attention_heads:6,num_key_value_heads:6,qk_nope_head_dim:24,"
          "qk_rope_head_dim:16,v_head_dim:24,vocab_size:4500}")


def test_the_inflated_stage_command_lines_pass_the_runs_own_checks(tmp_path):
    """gpu_check's first stage (`inflated`, issue 45) as it calls real_size.sh: specter, lru
    and specmoeoff at 16 and 24 GiB in real CUDA time on DeepSeek-V2-Lite inflated from
    small_deepseek, 3 items x 64 tokens, no virtual side; specter at 16 GiB with K per window
    (spec.k=adaptive); resident at full; small_deepseek's own
    acceptance; the hot path of specter and lru; the verdict with all of them. Every run.py
    override passes run.py's checks."""
    log = tmp_path / "argv.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {shlex.quote(str(log))}\n'
                    f'echo >> {shlex.quote(str(log))}\n')
    stub.chmod(0o755)
    gpu_check = (REPO / "scripts" / "gpu_check.sh").read_text()
    block = gpu_check[gpu_check.index("stage_inflated() {"):]
    block = block[:block.index("\n}\n")]
    env = {"PY": str(stub), "OUT": str(tmp_path / "out"), "MODEL": "deepseek",
           "WEIGHTS": "inflated", "SYSTEMS": "specter,lru,specmoeoff", "BUDGET_GB": "16,24",
           "ITEMS": "3", "TOKENS": "64", "VIRTUAL_HW": "none", "RESIDENT": "1", "ADAPTIVE": "1",
           "SOURCE_CHECK": "small_deepseek", "HOTPATH": "specter,lru", "H2D_GBPS": "50"}
    for key, value in env.items():  # the stage passes exactly these
        if key not in ("PY", "OUT", "H2D_GBPS"):  # (H2D_GBPS: measured there)
            assert f'{key}={value}' in block or f'{key}="${{INFLATED_' in block, key
    done = _script(env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["run.py", "run.py", "run.py", "run.py", "-m", "-m"]
    sweep, adaptive, resident, source, hot, verdict = calls
    assert "spec.k=adaptive" in adaptive and "system=specter" in adaptive
    assert "budget.gb=16" in adaptive
    for arg in ("model=deepseek", "model.weights=inflated", "system=specter,lru,specmoeoff",
                "hardware=cuda", "budget.gb=16,24", "workload.items=3",
                "workload.max_new_tokens=64"):
        assert arg in sweep, arg
    assert "system=resident" in resident and "budget=full" in resident
    assert "model=small_deepseek" in source and "system=specter" in source
    assert hot[:3] == ["-m", "experiments.hotpath", str(tmp_path / "out" / "hotpath")]
    assert "system=specter,lru" in hot and "budget.gb=16" in hot
    assert verdict[verdict.index("--virtual-hardware") + 1] == "none"
    assert verdict[verdict.index("--h2d-gbps") + 1] == "50"
    from specter.settings import checked_overrides

    for call in (sweep[2:], adaptive[1:], resident[2:], source[1:], hot[3:]):
        args = [a for a in call if a != "-m"]
        assert len(checked_overrides(args)) == len(args)


@pytest.mark.slow
def test_the_inflated_stage_chain_runs_end_to_end_on_the_cpu(tmp_path):
    """The inflated stage's chain on the CPU at reduced size: DeepSeek-V2-Lite's layout grown
    from tiny_deepseek to small widths (model.narrow) and 4 layers, a virtual profile standing
    in for the real side; every part writes, and the verdict prints the stage table with the
    source's acceptance beside the inflated model's (every layer of it live: its own draft and
    tokens, so not equal; docs/measurements/inflate-fidelity-2026-12-06)."""
    out = tmp_path / "inf"
    done = _script({"MODEL": "deepseek", "WEIGHTS": "inflated", "REAL_HW": "a100_pcie4_hf",
                    "VIRTUAL_HW": "none", "SYSTEMS": "specter,lru", "BUDGET_GB": "16",
                    "ITEMS": "1", "TOKENS": "8", "RESIDENT": "1", "ADAPTIVE": "1",
                    "SOURCE_CHECK": "tiny_deepseek",
                    "HOTPATH": "specter", "H2D_GBPS": "25", "OUT": str(out), "PY": sys.executable,
                    "EXTRA": f"model.inflate_from=tiny_deepseek model.layers=4 {NARROW}"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    df = records.load(out / "records")
    assert set(df["weights"]) == {"inflated"} and set(df["system"]) == {"specter", "lru",
                                                                      "resident"}
    t = real_size.stage_table(df, "a100_pcie4_hf", 25.0,
                              pd.read_csv(out / "hotpath" / "hotpath.csv"))
    assert t["link_floor_ms"].notna().all() and t["launches_per_token"].notna().any()
    engines = t.set_index("system")  # what each ran on (issue 45 item 6), from the records
    assert engines.loc["lru", "experts"] == engines.loc["specter", "experts"] == "fused"
    assert engines.loc["resident", "experts"] == "resident"
    assert engines.loc["specter", "step"].startswith("draft ")
    assert engines.loc["resident", "step"].startswith("decode ")
    src = records.load(out / "source_records")
    adaptive = df["k_source"].str.startswith("adaptive")
    spec = df[(df["system"] == "specter") & ~adaptive]
    assert spec["acceptance_rate"].mean() > 0.3 and src["acceptance_rate"].mean() > 0.3
    assert adaptive.sum() == 1 and "specter K=adaptive" in set(t["system"])
    assert df.loc[adaptive, "k_why"].iloc[0].startswith("K=")
    assert "acceptance: inflated" in done.stdout
