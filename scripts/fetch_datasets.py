"""Download the real prompt sets into the local cache that `specter.workloads` reads first.

For machines with internet access (the benchmark itself never downloads anything):

    python scripts/fetch_datasets.py [--items 100] [--out DIR] [--only gsm8k,c4]

Each dataset becomes `<out>/<name>.jsonl`, one {"text": ...} object per line, holding the first
N non-empty items in dataset order. Default out is `specter.workloads.dataset_dir()`
($SPECTER_DATA_DIR or data/cache). GPQA is gated on the Hugging Face Hub: accept its terms
and log in (`huggingface-cli login` or HF_TOKEN) first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specter.errors import UserError  # noqa: E402
from specter.workloads import DATASETS, dataset_dir  # noqa: E402

# name -> (load_dataset positional args, load_dataset keyword args, text field)
SOURCES: dict[str, tuple[tuple[str, ...], dict, str]] = {
    "gsm8k": (("openai/gsm8k", "main"), {"split": "test"}, "question"),
    "wikitext2": (("Salesforce/wikitext", "wikitext-2-v1"), {"split": "test"}, "text"),
    "humaneval": (("openai/openai_humaneval",), {"split": "test"}, "prompt"),
    "gpqa": (("Idavidrein/gpqa", "gpqa_main"), {"split": "train"}, "Pre-Revision Question"),
    "c4": (("allenai/c4", "en"), {"split": "validation", "streaming": True}, "text"),
}
assert tuple(SOURCES) == DATASETS, "SOURCES and specter.workloads.DATASETS must list the same datasets"


def write_first_items(texts: Iterable[str], items: int, path: Path) -> int:
    """Write the first `items` non-empty texts to `path` as jsonl, atomically; return how many."""
    if items < 1:
        raise UserError(f"--items must be at least 1 (got {items}).")
    chosen = list(itertools.islice((t for t in texts if t and t.strip()), items))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for t in chosen:
                f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(chosen)


def fetch(name: str, items: int, out: Path) -> int:
    """Download dataset `name` and write its first `items` non-empty texts to `out/<name>.jsonl`."""
    from datasets import load_dataset

    args, kwargs, field = SOURCES[name]
    ds = load_dataset(*args, **kwargs)
    return write_first_items((row[field] for row in ds), items, out / f"{name}.jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=100, help="non-empty items to keep per dataset (default 100)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the workload cache dir)")
    p.add_argument("--only", default=",".join(DATASETS), help="comma-separated subset of " + ",".join(DATASETS))
    a = p.parse_args(argv)
    out = a.out if a.out is not None else dataset_dir()
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SOURCES]
    if unknown or a.items < 1:
        what = f"unknown dataset(s) {', '.join(unknown)}" if unknown else f"--items must be at least 1 (got {a.items})"
        print(f"error: {what}; valid datasets are {', '.join(DATASETS)}.", file=sys.stderr)
        return 2

    failed = []
    for name in names:
        try:
            n = fetch(name, a.items, out)
        except Exception as e:  # one dataset failing must not stop the others
            hint = " (GPQA is gated: accept its terms on the Hub and log in with a token that has access)" if name == "gpqa" else ""
            print(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{hint}", file=sys.stderr)
            failed.append(name)
            continue
        note = "" if n == a.items else f" (only {n} non-empty items available)"
        print(f"{name}: wrote {n} items to {out / (name + '.jsonl')}{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
