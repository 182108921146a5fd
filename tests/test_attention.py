"""The attention implementation is a setting (model.attn), chosen, printed and recorded per
row, never left to chance; what cannot run is one sentence."""

from __future__ import annotations

import pytest
import torch

from specter.config import ModelConfig
from specter.errors import UserError
from specter.models import loading
from specter.placement.loader import load_model

CPU = torch.device("cpu")


def test_auto_and_explicit_choices():
    _, cls = loading.native_classes(loading.resolve_checkpoint(
        ModelConfig(name="tiny_deepseek", source="project"), None, 0, progress=False))
    assert loading.pick_attention(ModelConfig(name="x", source="hf"), cls, CPU) == ("sdpa", "auto")
    assert loading.pick_attention(ModelConfig(name="x", source="hf", attn="eager"), cls, CPU)[0] \
        == "eager"
    with pytest.raises(UserError, match="needs a CUDA device"):
        loading.pick_attention(ModelConfig(name="x", source="hf", attn="flash_attention_2"),
                               cls, CPU)


def test_the_choice_is_recorded_and_decodes_as_generate_with_it(tmp_path, tiny_models):
    """lru with eager attention: the rows say eager, and the tokens are plain `generate`'s
    on the model loaded with eager attention (a case apart from the default's)."""
    from experiments import records, runner
    from specter.config import RunConfig
    from test_offload import A100

    def cfg(attn: str, out):
        return RunConfig.from_dict({
            "model": {"name": "tiny_deepseek", "source": "project", "attn": attn},
            "budget": {"name": "low"}, "system": {"name": "lru"}, "dataset": {"name": "gsm8k"},
            "hardware": dict(A100), "out_dir": str(out), "progress": False,
            "workload": {"items": 1, "max_new_tokens": 8, "repeats": 1, "stop_on_eos": False}})

    runner.run(cfg("eager", tmp_path), log=lambda *_: None)
    runner.run(cfg("auto", tmp_path), log=lambda *_: None)
    df = records.load(tmp_path)
    assert sorted(df["attn_implementation"]) == ["eager", "sdpa"]
    assert df["case_id"].nunique() == 2
    ref = load_model(ModelConfig(name="tiny_deepseek", source="project", attn="eager"),
                             CPU, progress=False).model
    assert ref.config._attn_implementation == "eager"
    row = df[df["attn_implementation"] == "eager"].iloc[0]
    ids = torch.tensor([list(row["prompt_tokens"])])
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert list(row["output_tokens"]) == want[0, ids.shape[1]:].tolist()


def test_an_unknown_attention_is_one_sentence():
    from specter.config import RunConfig
    from test_config import _with

    d = _with("model.attn", "fast", None)
    d["model"] = {"name": "tiny_qwen", "source": "project", "attn": "fast"}
    with pytest.raises(UserError, match="model.attn must be auto, eager, sdpa or flash_attention_2"):
        RunConfig.from_dict(d)
