"""Project-made models: every tiny architecture loads from its saved checkpoint, has the MoE
structure of the model it scales down, and `resident` greedy decoding equals Hugging Face
`generate` token for token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specter.decoding.engines import resident_engine
from conftest import PROMPTS, TINY
from specter.models import archs, zoo

EXPECTED = {  # name -> (routed experts, top-k, shared experts)
    "tiny_deepseek": (64, 6, True), "tiny_qwen": (60, 4, True), "tiny_phi": (16, 2, False),
    "tiny_mixtral": (8, 2, False), "tiny_qwen3": (128, 8, False), "tiny_olmoe": (64, 8, False),
}


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_is_an_ordinary_hf_folder(name, tiny_models):
    lm = tiny_models(name)
    files = {p.name for p in lm.checkpoint.iterdir()}
    assert "config.json" in files and "tokenizer.json" in files
    assert any(f.endswith(".safetensors") for f in files)
    assert not any(f.endswith(".bin") for f in files)
    meta = json.loads((lm.checkpoint / "specter_build.json").read_text())
    assert meta["loss_last"] < meta["loss_first"] - 1.0  # it was trained
    # routing is not collapsed onto a few experts (a wide margin: trained builds give 0.8-0.99)
    assert 0.3 < meta["routing_load_entropy"] <= 1.0
    # trained in fp32, stored in bf16 (the recipe says so), loaded at the run's fp32 exactly
    from specter.placement.bytes import header

    assert meta["weights_dtype"] == zoo.WEIGHTS_DTYPE == "bfloat16"
    assert {t["dtype"] for f in lm.checkpoint.glob("*.safetensors")
            for t in header(f).values()} == {"BF16"}
    for p in lm.model.parameters():
        if p.device.type != "meta":
            assert p.dtype == torch.float32 and torch.equal(p, p.to(torch.bfloat16).float())
    spec = lm.spec
    assert (spec.num_experts, spec.top_k, spec.shared_experts) == EXPECTED[name]
    assert spec.num_moe_layers >= 2


@pytest.mark.parametrize("name", TINY)
def test_resident_equals_hf_generate(name, tiny_models):
    lm = tiny_models(name)
    engine = resident_engine(lm.model, torch.device("cpu"))
    seen: set[int] = set()
    for text in PROMPTS:
        ids = lm.tokenizer(text)["input_ids"][:16]
        ours = engine.generate(ids, 24).tokens
        ref = lm.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        assert ours == ref[0, len(ids):].tolist(), f"{name}: {text!r}"
        seen.update(ours)
    assert len(seen) >= 4  # the comparison is not between trivially constant outputs


def test_resident_stops_at_eos_like_generate(tiny_models):
    lm = tiny_models("tiny_qwen")
    ids = lm.tokenizer(PROMPTS[0])["input_ids"][:16]
    free = resident_engine(lm.model, torch.device("cpu"), stop_on_eos=False).generate(ids, 12).tokens
    # Make the 5th generated token the EOS: both decoders must stop right after it.
    lm.model.generation_config.eos_token_id = free[4]
    try:
        ours = resident_engine(lm.model, torch.device("cpu")).generate(ids, 12).tokens
        ref = lm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    finally:
        lm.model.generation_config.eos_token_id = lm.tokenizer.eos_token_id
    stop = free.index(free[4]) + 1
    assert ours == free[:stop]
    assert ours == ref[0, len(ids):].tolist()


@pytest.mark.slow
def test_build_is_hermetic_and_cached(tmp_path):
    """The same recipe gives bit-identical weights whatever the caller's thread count: one
    build here on 1 thread, one in another process that asked for 2 threads (and another hash
    seed). The builder trains on its own fixed count and gives the caller's back. (Mixtral's
    8 experts: the tiny build that trains fastest, 23 s against OLMoE's 36.)"""
    import subprocess
    import sys

    from specter import hermetic

    torch.set_num_threads(1)
    a = zoo.ensure_project_model("tiny_mixtral", seed=3, cache_dir=tmp_path / "a", progress=False)
    assert torch.get_num_threads() == 1  # restored
    code = ("import pathlib, torch; torch.set_num_threads(2); from specter.models import zoo; "
            "zoo.ensure_project_model('tiny_mixtral', seed=3, "
            f"cache_dir=pathlib.Path({str(tmp_path / 'b')!r}), "
            "progress=False); assert torch.get_num_threads() == 2")
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONHASHSEED="7")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parent.parent), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    b = zoo.checkpoint_dir("tiny_mixtral", 3, tmp_path / "b")
    meta_a, meta_b = (json.loads((d / "specter_build.json").read_text()) for d in (a, b))
    assert meta_a["weights_sha256"] == meta_b["weights_sha256"] == hermetic.checkpoint_checksum(b)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert meta_a["threads"] == meta_b["threads"] == hermetic.BUILD_THREADS
    assert meta_a["cpu"] == zoo.cpu_name() and meta_a["cpu_capability"] and meta_a["torch"]
    mtime = (a / "model.safetensors").stat().st_mtime
    assert zoo.ensure_project_model("tiny_mixtral", seed=3, cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime == mtime  # reused, not rebuilt
    assert zoo.checkpoint_dir("tiny_mixtral", 4, tmp_path / "a") != a  # the seed is in the key
    assert zoo.checkpoint_dir("tiny_mixtral", 3, tmp_path / "a", router_balance=0.1) != a
    # the build measured its routing on the benchmark prompts; result rows read it from there
    from specter.models.routing_stats import checkpoint_record

    routing = json.loads((a / "specter_build.json").read_text())["routing_benchmark"]
    assert routing["working_set"]["1"] == pytest.approx(2.0)  # Mixtral: top-2
    assert routing["prompts"] == 25 and 0 < routing["distinct_4"] <= 1
    rec = checkpoint_record(a)
    assert rec["model.ws_1"] == pytest.approx(2.0)
    assert rec["model.ws_growth"] == pytest.approx(routing["working_set"]["17"] / 2.0)
    assert rec["model.built_on"] == zoo.cpu_name() != ""  # weights depend on the CPU's kernels
    assert all(v != v for v in checkpoint_record(tmp_path).values())  # no record: nan


def test_train_seed_offset_moves_every_project_model(tmp_path, monkeypatch):
    """`$SPECTER_TRAIN_SEED_OFFSET` trains other weights from the same recipes: it adds to the
    seed, so it names another cache folder; a bad value is one sentence."""
    from specter import hermetic
    from specter.errors import UserError

    monkeypatch.delenv(hermetic.SEED_OFFSET_ENV, raising=False)
    plain = {s: zoo.checkpoint_dir("tiny_qwen", s, tmp_path) for s in (0, 3)}
    monkeypatch.setenv(hermetic.SEED_OFFSET_ENV, "3")
    assert zoo.checkpoint_dir("tiny_qwen", 0, tmp_path) == plain[3] != plain[0]
    assert zoo._recipe("tiny_qwen", 0)["seed"] == 3
    for bad in ("x", "-1", "1.5", str(2**64)):
        monkeypatch.setenv(hermetic.SEED_OFFSET_ENV, bad)
        with pytest.raises(UserError, match="SPECTER_TRAIN_SEED_OFFSET"):
            zoo.checkpoint_dir("tiny_qwen", 0, tmp_path)


def test_build_threads_restore_the_callers_count():
    from specter import hermetic

    before = torch.get_num_threads()
    with hermetic.build_threads(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), hermetic.build_threads(3):
        raise RuntimeError("a failed build")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("name", TINY)
def test_per_layer_balance_loss_reaches_every_router(name, tiny_models):
    """The recipe's router balance: one router per MoE layer, found by structure, and the
    loss's gradient reaches each of them."""
    from specter.models.introspect import experts_modules, routers

    model = tiny_models(name).model
    found = routers(model)
    assert len(found) == len(experts_modules(model))
    balance = zoo._BalanceLoss(model)
    try:
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), use_cache=False)
        loss = balance.take()
        assert loss.dim() == 0 and 0 < loss.item() < found[0].weight.shape[0]
        loss.backward()
        assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in found)
    finally:
        balance.remove()
        model.zero_grad(set_to_none=True)


def test_unknown_project_model_is_a_user_error():
    from specter.errors import UserError

    with pytest.raises(UserError, match="unknown project-made model 'tiny_gpt'"):
        archs.parse_name("tiny_gpt")
