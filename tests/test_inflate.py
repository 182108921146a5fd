"""`model.weights=inflated` (specter/models/inflate.py): a real model's widths and depth grown
from a project-made model so that it decodes the same tokens and routes with the same trained
routers. Checked at grown widths on tiny_deepseek (the real widths hold 2.2 GB per MoE layer in
fp32: the rules are the same at any width), through transformers' own module and through the
runner's loader, lossless and with the small model's acceptance."""

from __future__ import annotations

import glob

import pandas as pd
import pytest
import torch

from specter.errors import UserError
from specter.models import published
from specter.models.inflate import (Inflation, inflate_module, inflated_config, layer_plan,
                                    rope_stride)

# Widths above tiny_deepseek's (hidden 64, moe 32, kv_lora 32, 4 heads of 16+8 / 16) on every
# axis the rules grow, the rotary pairs 4 -> 8 (stride 2), and a vocabulary past the tokenizer's.
GROWN = {"hidden_size": 96, "intermediate_size": 160, "moe_intermediate_size": 48,
         "kv_lora_rank": 48, "num_attention_heads": 6, "num_key_value_heads": 6,
         "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 24, "vocab_size": 4500}


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from specter.config import ModelConfig
    from specter.placement.loader import load_model

    tiny_models("tiny_deepseek")
    return load_model(ModelConfig(name="tiny_deepseek", source="project"), torch.device("cpu"),
                      progress=False)


def _big(layers=6):
    return published.fixture_config("deepseek", layers=layers, narrow=GROWN)


def test_grown_widths_and_depth_decode_the_small_models_tokens(tiny):
    small = tiny.model
    big = inflate_module(small, _big())
    ids = torch.tensor([[1, 300, 400, 17, 99, 1000, 2000, 5, 6, 42]])
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits
    assert b.shape[-1] == GROWN["vocab_size"]
    assert (a - b[..., :a.shape[-1]]).abs().max() < 1e-4 * a.abs().max()
    # padded ids repeat a real id's logit exactly: greedy argmax never picks them
    assert torch.equal(b[..., a.shape[-1]:], b[..., :GROWN["vocab_size"] - a.shape[-1]])
    with torch.no_grad():
        ga = small.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        gb = big.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert ga.tolist() == gb.tolist()


def test_depth_is_live_layers_and_zero_output_copies_with_permuted_routers(tiny):
    small = tiny.model.config.to_dict()
    plans = layer_plan(_big(), small)
    assert [(p.layer, p.source, p.live) for p in plans] == [
        (0, 0, True), (1, 1, True), (2, 1, False), (3, 1, False), (4, 2, True), (5, 2, False)]
    perms = [p.perm for p in plans if not p.live]
    assert len(set(perms)) == len(perms) and all(sorted(p) == list(range(64)) for p in perms)
    big = inflate_module(tiny.model, _big())
    layers = big.model.layers
    for p in plans:
        o = layers[p.layer].self_attn.o_proj.weight
        assert bool(o.abs().sum() > 0) == p.live
        if p.layer:
            assert bool(layers[p.layer].mlp.experts.down_proj.abs().sum() > 0) == p.live
            assert bool(layers[p.layer].mlp.shared_experts.down_proj.weight.abs().sum() > 0) == p.live
    # a zero-output copy's router is the trained router with its rows permuted
    src = tiny.model.model.layers[1].mlp.gate.weight
    copy = layers[2].mlp.gate.weight
    perm = list(plans[2].perm)
    assert torch.allclose(copy[:, :64], src[perm])
    # its experts follow the same permutation (gate/up kept, down zero)
    assert torch.equal(layers[2].mlp.experts.gate_up_proj[5, :32, :64],
                       tiny.model.model.layers[1].mlp.experts.gate_up_proj[perm[5], :32])


def test_the_rotary_pairs_turn_at_the_small_models_frequencies(tiny):
    small = tiny.model.config.to_dict()
    cfg = inflated_config(_big(), small)
    assert rope_stride(4, 8) == 2 and "rope_scaling" not in cfg
    assert cfg["rope_theta"] == pytest.approx(10000.0 ** (8 / (2 * 4)))
    big = inflate_module(tiny.model, _big())
    kept = big.model.rotary_emb.inv_freq[torch.arange(4) * 2]
    assert torch.equal(kept, tiny.model.model.rotary_emb.inv_freq)
    assert cfg["rms_norm_eps"] == pytest.approx(small["rms_norm_eps"] * 64 / 96)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (small["bos_token_id"],
                                                          small["eos_token_id"])


def test_inflation_refuses_what_it_cannot_preserve(tiny):
    small = tiny.model.config.to_dict()
    with pytest.raises(UserError, match="grows widths only"):
        inflated_config(published.fixture_config("deepseek", layers=6,
                                                 narrow={**GROWN, "hidden_size": 32}), small)
    with pytest.raises(UserError, match="MoE layers"):
        inflated_config(published.fixture_config("deepseek", layers=2, narrow=GROWN), small)
    with pytest.raises(UserError, match="keeps n_routed_experts"):
        inflated_config(published.fixture_config("deepseek", layers=6,
                                                 narrow={**GROWN, "n_routed_experts": 32}), small)
    with pytest.raises(KeyError):
        Inflation({}, small, inflated_config(_big(), small)).tensor("model.unknown.weight", (1,))


def test_config_names_what_inflation_supports():
    from specter.settings import run_config

    with pytest.raises(UserError, match="no inflation rule"):
        run_config(["model=phi", "model.weights=inflated"])
    with pytest.raises(UserError, match="project-made"):
        run_config(["model=tiny_deepseek", "model.weights=inflated"])
    with pytest.raises(UserError, match="apply to model.weights=random or inflated"):
        run_config(["model=deepseek", "model.layers=4"])


def _rows(out) -> pd.DataFrame:
    return pd.concat(pd.read_parquet(f) for f in glob.glob(f"{out}/records/*/*.parquet"))


def test_the_runner_builds_it_lossless_with_the_small_models_acceptance(tiny, tmp_path,
                                                                       monkeypatch):
    """model=deepseek model.weights=inflated through the runner's loader (host store, INT4
    draft, specter's verification), at grown widths: the tokens are tiny_deepseek's own greedy
    ones and the acceptance is tiny_deepseek's under the same draft."""
    from experiments import runner
    from specter.settings import run_config

    real = published.fixture_config
    monkeypatch.setattr(published, "fixture_config",
                        lambda key, layers=None, narrow=None: real(key, layers, narrow or GROWN))
    common = ["system=specter", "budget=high", "dataset=gsm8k", "workload.items=2",
              "workload.max_new_tokens=16", "workload.stop_on_eos=false", "workload.repeats=1",
              "quant.method=rtn", "spec.k=4", "progress=false"]
    runner.run(run_config(["model=deepseek", "model.weights=inflated",
                           "model.inflate_from=tiny_deepseek", "model.layers=5", *common,
                           f"out_dir={tmp_path / 'big'}"]), log=lambda *_: None)
    runner.run(run_config(["model=tiny_deepseek", *common, f"out_dir={tmp_path / 'small'}"]),
               log=lambda *_: None)
    big, small = _rows(tmp_path / "big"), _rows(tmp_path / "small")
    assert (big["weights"] == "inflated").all()
    assert (big["model.inflated_from"] == "tiny_deepseek").all()
    big, small = big.sort_values("request_id"), small.sort_values("request_id")
    assert [list(t) for t in big["output_tokens"]] == [list(t) for t in small["output_tokens"]]
    assert big["acceptance_rate"].to_numpy() == pytest.approx(small["acceptance_rate"].to_numpy(), abs=0.03)


def test_widths_a_published_config_lacks_are_one_sentence(tiny, tmp_path):
    from specter.config import ModelConfig
    from specter.models import loading

    bad = ModelConfig(name="deepseek", source="hf", weights="inflated",
                      inflate_from="tiny_deepseek", narrow={"hidden_width": 96})
    with pytest.raises(UserError, match="model.narrow / model.layers for model=deepseek"):
        loading.inflated_folder(bad, None)
    with pytest.raises(UserError, match="model.narrow / model.layers for model=deepseek"):
        loading.random_folder(ModelConfig(name="deepseek", source="hf", weights="random",
                                          narrow={"hidden_width": 96}), tmp_path)
