"""Checkpoints as the hub ships them: a config.json that carries `auto_map` (code shipped in the
folder) loads transformers' native class for its model_type, and nothing in the folder is
imported or run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specter.config import ModelConfig
from specter.errors import UserError
from specter.models import loading

CPU = torch.device("cpu")
SHIPPED = {  # file -> code that leaves a mark if anyone imports it
    "configuration_shipped.py": "open({mark!r}, 'w').write('configuration imported')\n",
    "modeling_shipped.py": "open({mark!r}, 'w').write('modeling imported')\n",
}


def shipped_code_folder(tmp_path, tiny_models, name="tiny_deepseek", model_type=None):
    """A copy of a tiny checkpoint whose config.json asks for the folder's own code, as
    DeepSeek-V2-Lite's and Phi-3.5-MoE's do, with that code present and booby-trapped."""
    src = tiny_models(name).checkpoint
    out = tmp_path / "ckpt"
    shutil.copytree(src, out)
    mark = tmp_path / "imported.txt"
    for file, code in SHIPPED.items():
        (out / file).write_text(code.format(mark=str(mark)))
    cfg = json.loads((out / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_shipped.ShippedConfig",
                       "AutoModel": "modeling_shipped.ShippedModel",
                       "AutoModelForCausalLM": "modeling_shipped.ShippedForCausalLM"}
    cfg["architectures"] = ["ShippedForCausalLM"]
    if model_type:
        cfg["model_type"] = model_type
    (out / "config.json").write_text(json.dumps(cfg))
    return out, mark


def test_auto_map_loads_the_native_class_and_imports_nothing(tmp_path, tiny_models):
    folder, mark = shipped_code_folder(tmp_path, tiny_models)
    cfg = ModelConfig(name="deepseek", source="hf", path=str(folder))
    assert loading.resolve_checkpoint(cfg, None, 0) == folder
    note = loading.remote_code_note(folder)
    assert "modeling_shipped.ShippedForCausalLM" in note and "DeepseekV2ForCausalLM" in note
    lm = loading.load_model(cfg, CPU, progress=False)
    assert type(lm.model).__name__ == "DeepseekV2ForCausalLM"
    assert not hasattr(lm.model.config, "auto_map")
    ref = tiny_models("tiny_deepseek")
    ids = torch.tensor([ref.tokenizer("def f(x):")["input_ids"]])
    with torch.no_grad():  # the same weights, the same logits
        assert torch.equal(lm.model(ids).logits, ref.model(ids).logits)
    from specter.budget import bytes_spec

    spec, source = bytes_spec(cfg, folder)
    assert spec.num_experts == 64 and source.startswith("own:")
    loading.load_tokenizer(folder)
    assert not mark.exists(), mark.read_text()  # nothing shipped was imported


def test_auto_map_of_an_unknown_architecture_is_one_sentence(tmp_path, tiny_models):
    folder, mark = shipped_code_folder(tmp_path, tiny_models, model_type="shipped_moe")
    with pytest.raises(UserError, match="model_type 'shipped_moe' is not an architecture "
                                        "transformers .* knows. It ships its own code"):
        loading.resolve_checkpoint(ModelConfig(name="x", source="hf", path=str(folder)), None, 0)
    assert not mark.exists()
