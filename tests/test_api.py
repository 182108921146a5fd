"""The library's call, `specter.load(...)`, and `python -m specter`, tested through the public
call only: the tokens are the target's own greedy tokens and the runner's, the stream is the
same text, hub layouts load as shipped, and bad input is one sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import specter
from conftest import REPO, hf_greedy
from specter.errors import UserError

PROMPT = "Natalia sold clips to 48 of her friends in April."
# the eager A100 profile's virtual clock, the low budget: experts are offloaded and copied
SMALL = dict(budget="low", hardware="a100_pcie4_hf", k=4, max_prompt_tokens=32,
             max_new_tokens=16, overrides=["workload.stop_on_eos=false"])


@pytest.fixture(scope="module")
def llm():
    with specter.load("tiny_deepseek", **SMALL) as model:
        model.first = model.generate(PROMPT)  # its first request, as the runner's first row
        yield model


def test_generate_is_the_targets_greedy_decoding_and_streams_the_same_text(llm, tiny_models):
    out = llm.generate(PROMPT)
    ids = llm.ids(PROMPT)
    reference = tiny_models("tiny_deepseek").model
    reference.generation_config.eos_token_id = None  # loaded with stop_on_eos=false
    assert out.tokens == hf_greedy(reference, ids, 16)
    assert len(out.tokens) == 16 and out.text == llm.text(out.tokens)
    stats = out.stats
    assert stats["clock"] == "virtual" and stats["system"] == "specter"
    assert stats["tpot_ms"] > 0 and 0 <= stats["hit_rate"] <= 1 and stats["acceptance_rate"] > 0
    pieces = list(llm.stream(PROMPT))
    assert "".join(pieces) == out.text and llm.last.tokens == out.tokens
    assert len(pieces) > 1  # committed window by window, not once at the end
    assert llm.generate(ids).tokens == out.tokens  # ids in, the same request


def test_the_library_gives_the_runners_tokens(llm, tmp_path):
    from experiments import records, runner
    from specter.settings import run_config

    cfg = run_config(["model=tiny_deepseek", "system=specter", "budget=low",
                      "hardware=a100_pcie4_hf", "spec.k=4", "dataset=custom",
                      f"dataset.prompts=[\"{PROMPT}\"]", "workload.items=1",
                      "workload.repeats=1", "workload.prompt_tokens=32",
                      "workload.max_new_tokens=16", "workload.stop_on_eos=false",
                      f"out_dir={tmp_path}", "progress=false"])
    runner.run(cfg, log=lambda *_: None)
    row = records.load(tmp_path).iloc[0]
    assert list(row["output_tokens"]) == llm.first.tokens == llm.generate(PROMPT).tokens
    # the same virtual clock (a later request differs in the planner's running averages,
    # which carry over from request to request in the runner too)
    assert row["tpot_ms"] == pytest.approx(llm.first.stats["tpot_ms"], rel=1e-12)


@pytest.mark.parametrize("call, words", [
    (lambda: specter.load("tiny_deepseek", system="nope"), "unknown system 'nope'"),
    (lambda: specter.load("no_such_model"), "unknown model 'no_such_model'"),
    (lambda: specter.load("tiny_deepseek", budget_gb=0.001, hardware="a100_pcie4_hf"),
     "below the 6 this model needs at once"),
    (lambda: specter.load("tiny_deepseek", device="tpu"), "device must be auto, cpu or cuda"),
    (lambda: specter.load("tiny_deepseek", k=0), "spec.k"),
    (lambda: specter.load("tiny_deepseek", k="auto"), "spec.k=auto profiles K"),
    (lambda: specter.load("tiny_deepseek", budget="high", budget_gb=4), "not both"),
    (lambda: specter.load(path="/etc"), "made by the project"),
    (lambda: specter.load("deepseek", path="/etc"), "is not a checkpoint folder"),
    (lambda: specter.load("tiny_deepseek", overrides=["nonsense"]), "a setting is key=value"),
])
def test_bad_input_is_one_sentence(call, words):
    with pytest.raises(UserError) as e:
        call()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_requests_are_one_sentence_and_the_model_stays_usable(llm, tmp_path):
    for call, words in ((lambda: llm.generate("   "), "empty prompt"),
                        (lambda: llm.generate(PROMPT, max_new_tokens=17), "max_new_tokens=17"),
                        (lambda: llm.generate("word " * 40), "max_prompt_tokens"),
                        (lambda: llm.generate([10**9]), "outside the model's vocabulary"),
                        (lambda: llm.generate(PROMPT, temperature=0.7), "temperature")):
        with pytest.raises(UserError) as e:
            call()
        assert words in str(e.value), str(e.value)
    assert len(llm.generate(PROMPT, max_new_tokens=3).tokens) == 3
    (tmp_path / "notes").mkdir()
    with pytest.raises(UserError, match="is not a model: it holds no config.json"):
        specter.load(str(tmp_path / "notes"))


def test_a_closed_model_says_so_and_a_greedy_system_samples():
    """After close, a call is one sentence (not an AttributeError); a system that does not
    speculate loads with a temperature and samples (issue 58), the same seed the same draws."""
    lru = specter.load("tiny_deepseek", **{**SMALL, "system": "lru", "temperature": 0.8})
    drawn = lru.generate(PROMPT).tokens
    lru.close()
    with pytest.raises(UserError, match="this model is closed"):
        lru.generate(PROMPT)
    with specter.load("tiny_deepseek", **{**SMALL, "system": "lru", "temperature": 0.8}) as again:
        assert again.generate(PROMPT).tokens == drawn  # the first request's seed, again
    with specter.load("tiny_deepseek", **{**SMALL, "system": "resident"}) as greedy:
        assert greedy.generate(PROMPT).tokens != drawn


def test_a_hub_layout_loads_as_shipped_from_its_folder(tmp_path):
    """A folder in DeepSeek-V2's hub layout (per-expert tensor names, two shards, auto_map),
    given by path: loaded with its native class, decoded with its experts offloaded, equal to
    plain `generate` on the same folder."""
    import hub_fixtures
    from transformers import AutoModelForCausalLM

    folder = hub_fixtures.write_fixture("deepseek", tmp_path / "dsv2", layers=2,
                                        narrow=hub_fixtures.NARROW["deepseek"])
    with specter.load(str(folder), system="lru", budget="low", hardware="a100_pcie4_hf",
                      max_prompt_tokens=16, max_new_tokens=8,
                      overrides=["workload.stop_on_eos=false"]) as llm:
        assert llm.settings.model.name == "dsv2" and llm.settings.model.source == "hf"
        ids = [5, 17, 33, 2, 41, 9]
        out = llm.generate(ids)
        assert out.stats["hit_rate"] < 1  # experts really moved
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                               trust_remote_code=False)
    ref.generation_config.eos_token_id = None
    assert out.tokens == hf_greedy(ref, ids, 8)


def test_a_published_models_folder_takes_its_named_entry(tmp_path):
    """A folder whose config.json is DeepSeek-V2-Lite's (at any depth) takes conf/model/
    deepseek.yaml (its budget table, its paper K); another architecture the generic entry."""
    from specter.api import model_overrides
    from specter.models.published import fixture_config

    folder = tmp_path / "DeepSeek-V2-Lite"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fixture_config("deepseek", layers=2)))
    assert model_overrides(str(folder)) == ["model=deepseek", f"model.path={folder}"]
    narrow = fixture_config("deepseek", layers=2, narrow={"hidden_size": 64})
    (folder / "config.json").write_text(json.dumps(narrow))
    assert model_overrides(str(folder))[0] == "model=hf"
    assert model_overrides("deepseek-ai/DeepSeek-V2-Lite") == ["model=deepseek"]


def _module(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "specter", *args], cwd=REPO, env=env,
                          input=stdin, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_command_runs_the_embedded_default_with_no_model_arguments():
    """`python -m specter generate "prompt"`: the project-made small_deepseek, Specter, the
    high budget, the virtual clock of a modelled GPU on a machine without one."""
    done = _module("generate", "--max-new-tokens", "6", PROMPT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "model=small_deepseek" in done.stderr and "system=specter" in done.stderr
    assert "TPOT" in done.stderr.splitlines()[-1] and done.stdout.strip()


def test_the_command_chats_and_refuses_bad_input_in_one_line():
    chat = _module("chat", "--model", "tiny_deepseek", "--quiet", "--max-new-tokens", "4",
                   "--hardware", "a100_pcie4_hf", stdin=f"{PROMPT}\nAnd then?\n\n")
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.count("> ") == 3 and chat.stderr.count("TPOT") == 2
    bad = _module("generate", "--model", "tiny_deepseek", "--system", "nope", "--quiet", "x")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown system 'nope'")
    assert len(bad.stderr.strip().splitlines()) == 1
