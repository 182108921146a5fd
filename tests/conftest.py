"""Shared fixtures: tiny project-made models (built once into the shared cache) and helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TINY = ("tiny_deepseek", "tiny_qwen", "tiny_phi", "tiny_mixtral", "tiny_qwen3", "tiny_olmoe")

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "import os\nimport sys\n\nclass Reader:",
           "Janet has 3 apples and buys 5 more. How many"]


# One intra-op thread: the tiny models' tensors are too small to gain from more, and on a
# shared 2-core machine OpenMP's spinning threads slow every test several-fold.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models():
    """name -> LoadedModel on CPU, loaded through the same path as real checkpoints."""
    from specter.config import ModelConfig
    from specter.placement.loader import load_model

    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(ModelConfig(name=name, source="project"),
                                     torch.device("cpu"), progress=False)
        return cache[name]

    return get


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python run.py ARGS` in a subprocess, as a user would type it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(REPO / "run.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain Hugging Face `generate`, greedy, stopping at the model's EOS ids: the reference
    every decoding path must equal token for token."""
    from specter.decoding.batch import eos_ids

    eos = eos_ids(model)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(eos) or None, pad_token_id=0)
    return out[0, len(ids):].tolist()
