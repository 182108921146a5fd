"""The shipped builds (reference_models/): used when their recipe is today's, checked against
their recorded checksum, stored in the recipe's dtype (bf16) and loaded exactly at the run's,
small enough to travel with the working tree, and the local build from the recipe still one
switch away."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from specter.errors import UserError
from specter.models import zoo
from specter.placement.bytes import header

SHIPPED = sorted(p for p in zoo.REFERENCE_DIR.iterdir() if (p / "specter_build.json").is_file()) \
    if zoo.REFERENCE_DIR.is_dir() else []
# What GPU hosts receive is a copy of the working tree of at most 64 MiB; the tracked files
# are kept under this many bytes (docs/models.md).
TRACKED_TREE_BYTES = 55_000_000
STORED = {"bfloat16": "BF16"}  # the recipe's weights_dtype -> the safetensors header's name


def test_the_default_model_is_shipped():
    assert "small_deepseek" in [p.name for p in SHIPPED]


def test_small_qwen_is_built_from_its_recipe_not_shipped():
    """small_qwen (63 MiB in fp32, 31 in bf16) is not shipped: it trains on first use like the
    other project-made models, into the cache folder its recipe names. Nothing in the suite
    loads it (it takes about 30 minutes on 2 cores)."""
    assert not (zoo.REFERENCE_DIR / "small_qwen").exists()
    assert zoo.reference_checkpoint("small_qwen") is None
    local = zoo.checkpoint_dir("small_qwen")
    assert local.parent == zoo.default_cache_dir() / "models"
    assert local.name.endswith(zoo.recipe_digest(zoo._recipe("small_qwen", 0)))


def test_the_tracked_tree_fits_what_a_gpu_host_receives():
    """The shipped builds, and the tracked files in all, fit the working-tree copy a GPU host
    receives (64 MiB), with room for the untracked files a run carries."""
    shipped = sum(f.stat().st_size for p in SHIPPED for f in p.iterdir() if f.is_file())
    assert shipped < 40_000_000, shipped
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=zoo.REFERENCE_DIR.parent,
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    root = zoo.REFERENCE_DIR.parent
    files = [root / n for n in listed.decode().split("\0") if n]
    tracked = sum(f.stat().st_size for f in files if f.is_file())
    assert tracked < TRACKED_TREE_BYTES, tracked


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_build_is_todays_recipe_and_its_recorded_weights(folder):
    """A recipe change that is not shipped again would silently train locally and move every
    table: retrain and ship it (`python scripts/ship_reference.py NAME`)."""
    build = json.loads((folder / "specter_build.json").read_text())
    assert build["origin"] == "reference"
    assert zoo.reference_checkpoint(folder.name) == folder, (
        f"{folder.name}'s recipe changed since it was shipped: run "
        f"scripts/ship_reference.py {folder.name} and remeasure the tables made on it")
    zoo._VERIFIED.discard(folder)
    zoo.verify_reference(folder)  # raises when the weights are not the recorded ones
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (folder / name).is_file(), name
    assert zoo.is_reference(folder)
    # stored in the recipe's dtype, every tensor, and config.json says so
    dtype = build["weights_dtype"]
    assert dtype == zoo.WEIGHTS_DTYPE
    stored = {t["dtype"] for f in folder.glob("*.safetensors") for t in header(f).values()}
    assert stored == {STORED[dtype]}
    assert json.loads((folder / "config.json").read_text())["dtype"] == dtype


def test_the_shipped_default_loads_exactly_at_the_runs_dtype():
    """The bf16 weights load through the run's loader into fp32 on the CPU (the default dtype
    there) exactly: every parameter is fp32, holds a bf16 value, and equals transformers' own
    fp32 load of the folder; the non-expert ones equal the file's values."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specter.config import ModelConfig
    from specter.placement.loader import load_model

    lm = load_model(ModelConfig(name="small_deepseek", source="project"), torch.device("cpu"),
                    progress=False)
    assert zoo.is_reference(lm.checkpoint)
    mine = dict(lm.model.named_parameters())
    ref = AutoModelForCausalLM.from_pretrained(str(lm.checkpoint), dtype=torch.float32)
    theirs = dict(ref.named_parameters())
    assert set(mine) == set(theirs)
    for name, p in theirs.items():
        assert mine[name].dtype == torch.float32, name
        assert torch.equal(mine[name], p), name
        assert torch.equal(p, p.to(torch.bfloat16).float()), name
    stored = load_file(str(lm.checkpoint / "model.safetensors"))
    common = set(stored) & set(mine)
    assert len(common) > 10
    for name in common:
        assert torch.equal(mine[name], stored[name].float()), name


@pytest.fixture()
def shipped_tiny(tmp_path, monkeypatch, tiny_models):
    """tiny_deepseek's local build copied as a shipped one into a stand-in reference_models/."""
    local = zoo.ensure_project_model("tiny_deepseek", progress=False, build="local")
    root = tmp_path / "reference_models"
    shutil.copytree(local, root / "tiny_deepseek")
    meta = root / "tiny_deepseek" / "specter_build.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), origin="reference")))
    monkeypatch.setattr(zoo, "REFERENCE_DIR", root)
    return local, root / "tiny_deepseek"


def test_the_shipped_build_is_used_and_local_is_one_switch_away(shipped_tiny):
    local, shipped = shipped_tiny
    assert zoo.ensure_project_model("tiny_deepseek", progress=False) == shipped
    assert zoo.ensure_project_model("tiny_deepseek", progress=False, build="local") == local
    # another seed (or $SPECTER_TRAIN_SEED_OFFSET) is another recipe: never the shipped one
    assert zoo.reference_checkpoint("tiny_deepseek", seed=1) is None
    assert zoo.reference_checkpoint("tiny_deepseek", router_balance=0.5) is None
    with pytest.raises(UserError, match="unknown model.build 'remote'"):
        zoo.ensure_project_model("tiny_deepseek", progress=False, build="remote")


def test_a_changed_recipe_falls_back_to_the_local_build(shipped_tiny):
    local, shipped = shipped_tiny
    meta = shipped / "specter_build.json"
    build = json.loads(meta.read_text())
    meta.write_text(json.dumps(dict(build, recipe_version=build["recipe_version"] - 1)))
    assert zoo.reference_checkpoint("tiny_deepseek") is None
    assert zoo.ensure_project_model("tiny_deepseek", progress=False) == local


def test_shipped_weights_that_are_not_the_recorded_ones_are_one_sentence(shipped_tiny):
    _, shipped = shipped_tiny
    f = next(shipped.glob("*.safetensors"))
    f.write_text("version https://git-lfs.github.com/spec/v1\n")  # what a clone without LFS holds
    with pytest.raises(UserError, match="do not match their recorded checksum.*model.build=local"):
        zoo.ensure_project_model("tiny_deepseek", progress=False)


def test_rows_say_which_weights_they_decoded(shipped_tiny, tmp_path):
    from test_runner import smoke_cfg

    from experiments import records, runner
    from experiments.summarize import short

    for build in ("reference", "local"):
        out = tmp_path / build
        runner.run(smoke_cfg(out, model={"build": build},
                             workload={"items": 1, "max_new_tokens": 4, "repeats": 1}),
                   log=lambda *_: None)
        df = records.load(out)
        assert set(df["model.origin"]) == {build}
        assert df["model.weights_sha256"].nunique() == 1
        word = "shipped reference build" if build == "reference" else "local build"
        assert f"weights: {word} " in short(df)
    # the shipped build and a local one of the same recipe are two cases, never resumed as one
    cases = {p.name for p in (tmp_path / "reference" / "records").iterdir()} | \
        {p.name for p in (tmp_path / "local" / "records").iterdir()}
    assert len(cases) == 2
