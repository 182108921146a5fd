"""Project-made models: every tiny architecture loads from its saved checkpoint, has the MoE
structure of the model it scales down, and `resident` greedy decoding equals Hugging Face
`generate` token for token."""

from __future__ import annotations

import json

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
    assert 0.3 < meta["routing_load_entropy"] < 1.0  # routing is data-dependent, not collapsed
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
def test_build_is_deterministic_and_cached(tmp_path):
    # OLMoE: its training was thread-order dependent before deterministic kernels were forced.
    a = zoo.ensure_project_model("tiny_olmoe", seed=3, cache_dir=tmp_path / "a", progress=False)
    b = zoo.ensure_project_model("tiny_olmoe", seed=3, cache_dir=tmp_path / "b", progress=False)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    mtime = (a / "model.safetensors").stat().st_mtime
    assert zoo.ensure_project_model("tiny_olmoe", seed=3, cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime == mtime  # reused, not rebuilt
    assert zoo.checkpoint_dir("tiny_olmoe", 4, tmp_path / "a") != a  # the seed is in the key
    assert zoo.checkpoint_dir("tiny_olmoe", 3, tmp_path / "a", router_balance=0.1) != a
    # the build measured its routing on the benchmark prompts; result rows read it from there
    from specter.models.routing_stats import checkpoint_record

    routing = json.loads((a / "specter_build.json").read_text())["routing_benchmark"]
    assert routing["working_set"]["1"] == pytest.approx(8.0)  # OLMoE: top-8
    assert routing["prompts"] == 25 and 0 < routing["distinct_4"] <= 1
    rec = checkpoint_record(a)
    assert rec["model.ws_1"] == pytest.approx(8.0)
    assert rec["model.ws_growth"] == pytest.approx(routing["working_set"]["17"] / 8.0)
    assert rec["model.built_on"] == zoo.cpu_name() != ""  # weights depend on the CPU's kernels
    assert all(v != v for v in checkpoint_record(tmp_path).values())  # no record: nan


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
