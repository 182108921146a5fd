"""Resident's decode step as one compiled graph over a static cache
(specter/decoding/compiled_decode.py): a graph with no break (fullgraph=True fails on any), the
tokens of plain `generate` on every tiny architecture, and the knob through the runner."""

from __future__ import annotations

import pytest
import torch

from baselines.resident import Config as ResidentConfig
from conftest import TINY, hf_greedy, run_cli
from specter.config import ModelConfig
from specter.clock.kinds import clock_kind
from specter.decoding.compiled_decode import CompiledDecode, resolve_system_compile
from specter.decoding.batch import DeviceMemory, eos_ids
from specter.decoding.loop import greedy_decode_batch
from specter.errors import UserError
from specter.clock.timing import Timing
from specter.placement.loader import load_model

CPU = torch.device("cpu")
PROMPTS = ("The committee met on Tuesday to discuss the budget, and after a long debate",
           "Question: a farmer has 12 cows and buys 5 more. How many")


_hf = hf_greedy


@pytest.mark.parametrize("name", TINY)
def test_a_compiled_resident_step_is_the_target_token_for_token(name):
    lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), CPU, progress=False)
    want = [_hf(lm.model, lm.tokenizer(p)["input_ids"][:16], 12) for p in PROMPTS]
    static = CompiledDecode(lm.model, compiler="eager", positions=40)
    link = Timing.wall(CPU).link
    for p, expect in zip(PROMPTS, want):
        ids = lm.tokenizer(p)["input_ids"][:16]
        with torch.no_grad():
            got = static.generate(ids, 12, CPU, link, eos_ids(lm.model), DeviceMemory(lm.model, CPU))
        eager = greedy_decode_batch(lm.model, [ids], 12, CPU, link, eos_ids(lm.model),
                                    DeviceMemory(lm.model, CPU))[0]
        assert got.tokens == expect == eager.tokens  # the prefill's HF loop still serves T > 1
    assert static.compiles == 1 and static.steps_run > 0  # one compilation for the run


def test_a_captured_resident_step_replays_one_graph_per_step():
    """The CUDA path (issue 45 item 6: resident gets the captured decode the draft has) on the
    CPU, over the stand-in capture (tests/fake_cuda.py): the whole step captured once, at the
    first step, with one device sync; each later step one replay and nothing else; the tokens
    are plain generate's, and a second request captures nothing."""
    from collections import Counter

    from fake_cuda import FakeCuda
    from specter.counting import OpCounter

    lm = load_model(ModelConfig(name="tiny_deepseek", source="project", dtype="float32"), CPU,
                    progress=False)
    fake = FakeCuda()
    static = CompiledDecode(lm.model, compiler="eager", positions=40, capture=fake.capture_graph)
    link = Timing.wall(CPU).link
    for i, p in enumerate(PROMPTS):
        ids = lm.tokenizer(p)["input_ids"][:16]
        want = _hf(lm.model, ids, 12)
        with torch.no_grad(), OpCounter() as counter:
            got = static.generate(ids, 12, CPU, link, set(), DeviceMemory(lm.model, CPU))
        assert got.tokens == want
        total = sum(counter.counts.values(), start=Counter())
        assert total["graph_replays"] == 11  # 12 tokens: the prefill's and 11 replays
        assert static.captures == fake.captures == 1 and fake.log.device_syncs == 1
    assert fake.replays == static.steps_run == 22


def test_resolve_system_compile_says_why_and_refuses_on_in_one_sentence():
    assert resolve_system_compile("off", 1, clock_kind("wall")) == (False, "system.compile=off")
    assert resolve_system_compile("auto", 1, clock_kind("wall"))[0]
    on, why = resolve_system_compile("auto", 1, clock_kind("virtual"))
    assert not on and "virtual clock" in why
    assert resolve_system_compile("on", 1, clock_kind("virtual"))[0]  # charged as a captured graph
    assert resolve_system_compile("on", 1, clock_kind("cuda"))[0]  # a GPU's own clock
    with pytest.raises(UserError, match="emulated clock"):
        resolve_system_compile("on", 1, clock_kind("emulated"))
    with pytest.raises(UserError, match="system.compile=on cannot compile"):
        resolve_system_compile("on", 4, clock_kind("wall"))
    with pytest.raises(UserError, match="system.compile must be one of"):  # with its config
        ResidentConfig(name="resident", compile="yes").validate()
    assert resolve_system_compile("auto", 1, clock_kind("cuda"))[0]  # captured as one CUDA graph


def test_the_default_stays_eager_on_a_virtual_clock_and_says_why(tmp_path):
    """system.compile's default (auto) stays eager on a virtual clock (its charges come from
    hooks a graph does not run), with no warm-up; on hardware=cpu it compiles (the next test,
    whose compilation runs in the runner's untimed warm-up request)."""
    import pandas as pd

    common = ("model=tiny_qwen", "system=resident", "dataset=gsm8k", "workload.items=1",
              "workload.repeats=1", "workload.max_new_tokens=8", "progress=false")
    r = run_cli(*common, "hardware=a100_pcie4_hf", f"out_dir={tmp_path / 'virtual'}")
    assert r.returncode == 0, r.stderr[-2000:]
    virtual = pd.read_parquet(next((tmp_path / "virtual").glob("records/*/*.parquet"))).iloc[0]
    assert not bool(virtual["decode_compiled"]) and "virtual clock" in virtual["decode_compile"]
    assert virtual["compile_warmup_s"] == 0.0


def test_compiled_resident_runs_through_the_runner_and_says_so(tmp_path):
    import pandas as pd

    rows = {}
    for setting in ("off", "on"):
        out = tmp_path / setting
        r = run_cli("model=tiny_qwen", "system=resident", "hardware=cpu", "dataset=gsm8k",
                    "workload.items=1", "workload.repeats=1", "workload.max_new_tokens=8",
                    "progress=false", f"system.compile={setting}",
                    "system.compile_backend=eager", f"out_dir={out}")
        assert r.returncode == 0, r.stderr[-2000:]
        rows[setting] = pd.read_parquet(next(out.glob("records/*/*.parquet"))).iloc[0]
    off, on = rows["off"], rows["on"]
    assert list(on["output_tokens"]) == list(off["output_tokens"])
    assert bool(on["decode_compiled"]) and not bool(off["decode_compiled"])
    # compiled in the untimed warm-up request, not in the timed one
    assert on["decode_compile"] == "system.compile=on" and on["decode_compiles"] == 0
    assert on["compile_warmup_s"] > 0 and off["compile_warmup_s"] == 0.0
    assert on["case_id"] != off["case_id"]
    # the benchmark's table reads both kinds of compiled step
    from experiments import records
    from experiments.compile_table import table

    t = table(pd.concat([records.load(tmp_path / s) for s in ("off", "on")]))
    assert list(t["step"]) == ["eager", "compiled"] and t["compiles"].tolist() == [0, 1]


def test_on_a_virtual_clock_a_compiled_step_is_charged_as_a_captured_graph(tmp_path):
    """system.compile=on on the eager A100 profile: the tokens of the eager step, the step
    charged after it runs as a captured graph (its kernels' time and one launch: the eager
    profile's framework costs gone), so TPOT falls; the roofline's compute is still charged."""
    import pandas as pd

    rows = {}
    for setting in ("off", "on"):
        out = tmp_path / setting
        r = run_cli("model=tiny_deepseek", "system=resident", "hardware=a100_pcie4_hf",
                    "dataset=gsm8k", "workload.items=1", "workload.repeats=1",
                    "workload.max_new_tokens=8", "progress=false", f"system.compile={setting}",
                    "system.compile_backend=eager", f"out_dir={out}")
        assert r.returncode == 0, r.stderr[-2000:]
        rows[setting] = pd.read_parquet(next(out.glob("records/*/*.parquet"))).iloc[0]
    off, on = rows["off"], rows["on"]
    assert list(on["output_tokens"]) == list(off["output_tokens"])
    assert bool(on["decode_captured"]) and not bool(off["decode_captured"])
    assert 0 < on["tpot_ms"] < 0.5 * off["tpot_ms"], (on["tpot_ms"], off["tpot_ms"])
