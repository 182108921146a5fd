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
from specter.placement.loader import load_model

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
    lm = load_model(cfg, CPU, progress=False)
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


# -- what a checkpoint needs, from its headers alone -------------------------------------------
@pytest.mark.parametrize("name,routed", [
    ("model.layers.1.mlp.experts.0.gate_proj.weight", True),  # DeepSeek, Qwen, OLMoE, GLM
    ("model.layers.3.block_sparse_moe.experts.7.w2.weight", True),  # Mixtral, Phi
    ("model.layers.0.mlp.experts.gate_up_proj_blocks", True),  # gpt-oss (fused, MXFP4)
    ("model.layers.0.mlp.experts.down_proj_bias", True),
    ("model.layers.1.mlp.shared_experts.gate_proj.weight", False),  # DeepSeek's shared
    ("model.layers.1.mlp.shared_expert.up_proj.weight", False),  # Qwen1.5-MoE's shared
    ("model.layers.1.mlp.shared_expert_gate.weight", False),
    ("model.layers.1.mlp.gate.weight", False),  # routers
    ("model.layers.1.block_sparse_moe.gate.weight", False),
    ("model.layers.0.mlp.router.weight", False),
    ("model.layers.0.mlp.gate_proj.weight", False),  # a dense first layer
])
def test_routed_expert_tensors_are_known_by_name(name, routed):
    from specter.placement.bytes import is_routed_expert

    assert is_routed_expert(name) == routed


def test_header_bytes_equal_the_loaded_model_and_refusals_are_one_sentence(tiny_models):
    from specter.placement.bytes import GiB, CheckpointBytes, check_fits, checkpoint_bytes
    from specter.models.introspect import experts_modules

    lm = tiny_models("tiny_qwen")
    b = checkpoint_bytes(lm.checkpoint, element_size=2)  # as if loaded in half precision
    experts = sum(t.numel() * 2 for _, m in experts_modules(lm.model)
                  for t in (m.gate_up_proj, m.down_proj))
    total = sum(p.numel() * 2 for p in lm.model.parameters())
    assert b.expert_bytes == experts and b.non_expert_bytes == total - experts
    phi = CheckpointBytes(expert_bytes=int(78.1 * GiB), non_expert_bytes=int(3.2 * GiB),
                          tensors=1, expert_tensors=1)
    with pytest.raises(UserError, match=r"^model=phi needs 78.1 GiB of host memory for its "
                                        r"routed experts; this process can have 23.4 GiB.$"):
        check_fits("phi", phi, True, device_bytes=None, host_bytes=int(23.4 * GiB))
    with pytest.raises(UserError, match=r"needs 3.2 GiB of device memory for its non-expert"):
        check_fits("phi", phi, True, device_bytes=2 * GiB, host_bytes=128 * GiB)
    with pytest.raises(UserError, match=r"needs 81.3 GiB of device memory for all its weights"):
        check_fits("phi", phi, False, device_bytes=40 * GiB, host_bytes=128 * GiB)
    check_fits("phi", phi, True, device_bytes=40 * GiB, host_bytes=128 * GiB)  # offloaded: fits
    with pytest.raises(UserError, match=r"needs 81.3 GiB of device memory for all its weights "
                                        r"while loading"):  # today's CUDA loader
        check_fits("phi", phi, True, device_bytes=40 * GiB, host_bytes=128 * GiB,
                   loads_whole=True)


# -- the seed models' hub layouts, as shipped ---------------------------------------------------
SYSTEMS_ON_HUB = ("resident", "lru", "specmoeoff", "specter")
# Random weights can fall into a fixed point (one token forever): Phi's seed-0 fixture does,
# which would make the comparison trivial. The weights are drawn, not trained, so a seed is
# the same fixture on every machine; the test checks the outputs are not constant.
FIXTURE_SEED = {"phi": 1}


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    """key -> a folder in that hub repository's layout (hub_fixtures.py: published config.json,
    tensor names, bf16, two shards and an index; 2 layers, narrowed widths, random weights)."""
    import hub_fixtures

    made = {}

    def get(key: str):
        if key not in made:
            out = tmp_path_factory.mktemp(f"hub-{key}")
            made[key] = hub_fixtures.write_fixture(key, out, layers=2,
                                                   narrow=hub_fixtures.NARROW[key],
                                                   seed=FIXTURE_SEED.get(key, 0))
        return made[key]
    return get


def _hub_run_cfg(key: str, folder, system: str, out_dir, slots: int) -> "RunConfig":
    import yaml

    from conftest import REPO
    from specter.config import RunConfig
    from test_offload import A100

    model = yaml.safe_load((REPO / "conf" / "model" / f"{key}.yaml").read_text())
    return RunConfig.from_dict({
        "model": {**model, "path": str(folder)}, "budget": {"name": "high", "slots": slots},
        "system": {"name": system}, "dataset": {"name": "gsm8k"},
        "hardware": {**A100, "charge": "own"},
        "workload": {"items": 2, "max_new_tokens": 8, "repeats": 1, "stop_on_eos": False},
        "quant": {"calib_tokens": 256}, "spec": {"k": 3}, "out_dir": str(out_dir),
        "progress": False})


@pytest.mark.slow
@pytest.mark.parametrize("key", ["deepseek", "phi", "qwen", "mixtral", "qwen3", "olmoe", "glm"])
def test_hub_layouts_decode_as_plain_generate(key, hub_folder, tmp_path):
    """Each seed model's hub layout, loaded as shipped (auto_map where the hub has it), run by
    the runner with resident, lru, specmoeoff and specter at top-k + 1 slots: every system's
    tokens equal plain Hugging Face `generate` on the same folder."""
    from experiments import records, runner

    folder = hub_folder(key)
    cfg_json = json.loads((folder / "config.json").read_text())
    assert bool(cfg_json.get("auto_map")) == (key in ("deepseek", "phi"))  # as the hub ships it
    from transformers import AutoModelForCausalLM

    # The reference: plain transformers on the folder (trust_remote_code=False: its native
    # class), every tensor of the checkpoint used and none missing.
    ref_model, info = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, trust_remote_code=False, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ref_model.generation_config.eos_token_id = None  # the runs do not stop at EOS either
    ours = load_model(ModelConfig(name=key, source="hf", path=str(folder)), CPU,
                              progress=False)
    assert type(ours.model) is type(ref_model)
    if key == "phi":  # the hub's spelling, not the native class's
        assert cfg_json["architectures"] == ["PhiMoEForCausalLM"]
        assert type(ours.model).__name__ == "PhimoeForCausalLM"
    top_k = ours.spec.top_k
    for system in SYSTEMS_ON_HUB:
        out = tmp_path / system
        runner.run(_hub_run_cfg(key, folder, system, out, top_k + 1), log=lambda *_: None)
        df = records.load(out)
        assert len(df) == 2, system
        emitted = {t for row in df["output_tokens"] for t in row}
        assert len(emitted) >= 4, (key, "a trivial comparison: the outputs are constant")
        if system != "resident":  # experts really moved
            assert df["demand_misses"].sum() > 0, (key, system)
        row0 = df.iloc[0]  # the loader's account of the device: the non-expert weights only
        non_expert, experts = row0["ckpt_non_expert_bytes"], row0["ckpt_expert_bytes"]
        peak = row0["load_peak_device_bytes"]
        if system == "resident":
            # (GLM's e_score_correction_bias: a buffer, in the headers, not a parameter)
            assert peak >= non_expert + experts - 4096, (key, system, peak, non_expert, experts)
        else:  # (+ the modules' own buffers: RoPE tables)
            assert non_expert <= peak < non_expert + min(2**20, experts // 8), (key, system, peak)
        for _, row in df.iterrows():
            ids = torch.tensor([list(row["prompt_tokens"])])
            ref = ref_model.generate(ids, max_new_tokens=8, do_sample=False,
                                     pad_token_id=ours.tokenizer.pad_token_id or 0)
            assert list(row["output_tokens"]) == ref[0, ids.shape[1]:].tolist(), (key, system)


@pytest.mark.slow
def test_deepseek_v2_lite_at_its_real_widths(tmp_path):
    """DeepSeek-V2-Lite's layout at its real widths (hidden 2048, 64 experts of 1408, MLA,
    vocab 102400; a dense first layer and one MoE layer: 1.09 B parameters, 2 GiB in bf16):
    lru and specter (an RTN draft: GPTQ at these widths is minutes on 2 cores) give plain
    generate's tokens; the header accounting matches the loaded model. One model in memory at
    a time (fp32 on the CPU: 4.4 GB)."""
    import gc

    import hub_fixtures
    from transformers import AutoModelForCausalLM

    from experiments import records, runner
    from specter.placement.bytes import checkpoint_bytes

    folder = hub_fixtures.write_fixture("deepseek", tmp_path / "ds", layers=2)
    ref_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                     trust_remote_code=False)
    ref_model.generation_config.eos_token_id = None
    b = checkpoint_bytes(folder, element_size=4)
    assert b.expert_bytes == 64 * 3 * 1408 * 2048 * 4
    assert b.expert_bytes + b.non_expert_bytes == 4 * sum(p.numel() for p in ref_model.parameters())
    refs = {}
    for system in ("lru", "specter"):
        cfg = _hub_run_cfg("deepseek", folder, system, tmp_path / system, 7)
        cfg.quant.method, cfg.workload.items, cfg.workload.max_new_tokens = "rtn", 1, 6
        if not refs:  # the prompts the runner will decode: the workload's first item
            from experiments.runner import _workload
            from specter.workloads import truncate_prompt

            tok = loading.load_tokenizer(folder)
            for text in _workload(cfg).texts[:1]:
                ids = truncate_prompt(tok, text, cfg.workload.prompt_tokens)
                out = ref_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                         pad_token_id=tok.pad_token_id or 0)
                refs[tuple(ids)] = out[0, len(ids):].tolist()
            del ref_model
            gc.collect()
        runner.run(cfg, log=lambda *_: None)
        df = records.load(tmp_path / system)
        for _, row in df.iterrows():
            assert list(row["output_tokens"]) == refs[tuple(row["prompt_tokens"])], system
        assert row["ckpt_expert_bytes"] == b.expert_bytes and row["load_s"] > 0
        gc.collect()


def test_gpt_oss_is_refused_in_one_sentence_that_says_why(tmp_path, tiny_models):
    folder, _ = shipped_code_folder(tmp_path, tiny_models, model_type="gpt_oss")
    with pytest.raises(UserError, match=r"model_type 'gpt_oss' is not supported: its experts "
                                        r"are fused across experts") as err:
        loading.resolve_checkpoint(ModelConfig(name="x", source="hf", path=str(folder)), None, 0)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_new_model_runs_from_the_command_line_on_its_gib_budget(hub_folder, tmp_path):
    """`python run.py model=mixtral model.path=DIR budget=high`: the conf entry composes, the
    budget (device GiB, no paper slots) resolves by the byte accounting, the run writes its
    rows; without the folder, one sentence says how to get the weights."""
    from conftest import run_cli

    from experiments import records

    folder = hub_folder("mixtral")
    done = run_cli("model=mixtral", f"model.path={folder}", "budget=high", "system=lru",
                   "workload.items=1", "workload.max_new_tokens=4", "workload.repeats=1",
                   f"out_dir={tmp_path / 'res'}", "progress=false")
    assert done.returncode == 0, done.stderr[-2000:]
    row = records.load(tmp_path / "res").iloc[0]
    assert row["budget_gb"] == 80 and row["budget_rule"] == "budget.gb=80 (byte accounting)"
    missing = run_cli("model=glm", f"model.path={tmp_path / 'nowhere'}", "system=lru",
                      f"out_dir={tmp_path / 'x'}", "progress=false")
    assert missing.returncode == 2 and "hf download zai-org/GLM-4.7-Flash" in missing.stderr
