"""Routed experts loaded straight into host memory (placement/loader.py): the device receives
the non-expert weights only, the host one copy of the experts, and the result is the model
transformers itself loads from the same folder, tensor for tensor, on every hub layout."""

from __future__ import annotations

import json

import pytest
import torch

from specter.config import ModelConfig
from specter.errors import UserError
from specter.models import loading
from specter.placement.loader import load_model
from specter.placement.plan import PlacementPlan
from specter.placement.bytes import checkpoint_bytes, header, is_routed_expert
from specter.models.introspect import experts_modules
from specter.offload.store import expert_weights, host_store

CPU = torch.device("cpu")
KEYS = ["deepseek", "phi", "qwen", "mixtral", "qwen3", "olmoe", "glm"]


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    import hub_fixtures

    made = {}

    def get(key: str):
        if key not in made:
            made[key] = hub_fixtures.write_fixture(key, tmp_path_factory.mktemp(f"hl-{key}"),
                                                   layers=2, narrow=hub_fixtures.NARROW[key])
        return made[key]
    return get


def _reference(folder, dtype):
    """transformers' own load of the folder (its native class, every tensor used)."""
    config, model_class = loading.native_classes(folder)
    model, info = model_class.from_pretrained(str(folder), config=config, dtype=dtype,
                                              trust_remote_code=False, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.config._experts_implementation = "eager"  # the loop the store's experts sum like
    return model.eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("key", KEYS)
def test_host_load_is_transformers_load(key, dtype, hub_folder):
    """Every non-expert parameter and buffer equals transformers' (value and dtype: the
    routers DeepSeek and GLM keep in fp32 included), every expert in the store equals its slice
    of transformers' fused parameters, the draft's source checksum is the same, and so are the
    logits."""
    from specter.quant.calibrate import source_checksum

    folder = hub_folder(key)
    ref = _reference(folder, getattr(torch, dtype))
    ours = load_model(ModelConfig(name=key, source="hf", path=str(folder), dtype=dtype),
                              CPU, progress=False, plan=PlacementPlan("host"))
    model = ours.model
    assert type(model) is type(ref)
    expert_ids = {id(p) for _, m in experts_modules(ref) for p in m.parameters(recurse=False)}
    theirs = dict(ref.named_parameters())
    mine = dict(model.named_parameters())
    for name, p in theirs.items():
        if id(p) in expert_ids:
            assert mine[name].device.type == "meta", name  # a shape, never weights
            continue
        assert mine[name].dtype == p.dtype and torch.equal(mine[name], p), name
    for name, b in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name
    for l in range(len(experts_modules(ref))):
        for e in range(ours.spec.num_experts):
            for a, b in zip(expert_weights(model, l, e), expert_weights(ref, l, e)):
                assert a.dtype == b.dtype and torch.equal(a, b), (l, e)
    assert ours.spec == load_model(
        ModelConfig(name=key, source="hf", path=str(folder), dtype=dtype), CPU,
        progress=False).spec
    assert source_checksum(model) == source_checksum(ref)  # the quantized draft's cache key
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2, 29]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key", KEYS)
def test_the_plan_that_puts_everything_on_the_device_is_transformers_load(key, dtype, hub_folder):
    """The resident systems' plan (everything on the device) through the same loader: every
    parameter and buffer, the routed experts' fused parameters included, equals transformers'
    own `from_pretrained` in value and dtype, and so do the logits."""
    folder = hub_folder(key)
    ref = _reference(folder, getattr(torch, dtype))
    ours = load_model(ModelConfig(name=key, source="hf", path=str(folder), dtype=dtype), CPU,
                      progress=False)
    assert ours.placed.host_bytes == 0 and not ours.placed.host_names
    model = ours.model
    assert type(model) is type(ref) and host_store(model) is None
    mine = dict(model.named_parameters())
    assert set(mine) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        assert mine[name].dtype == p.dtype and torch.equal(mine[name], p), name
    for name, b in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), b), name
    assert ours.placed.device_bytes == sum(
        t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    model.config._experts_implementation = "eager"
    ids = torch.tensor([[3, 17, 5, 42, 8, 11, 2, 29]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_no_routed_expert_reaches_the_device(hub_folder):
    """With the device played by `meta` (a tensor placed there keeps its shape and loses its
    values): every parameter of the loaded model is on the device and none holds a value, yet
    the store holds every expert's exact weights, so they went from the files to the host
    without passing through the device. The loader's account names every checkpoint tensor
    once: the routed ones to the host, the rest to the device."""
    folder = hub_folder("deepseek")
    ref = _reference(folder, torch.float32)
    ours = load_model(ModelConfig(name="deepseek", source="hf", path=str(folder),
                                          dtype="float32"), torch.device("meta"),
                              progress=False, plan=PlacementPlan("host"))
    assert {p.device.type for p in ours.model.parameters()} == {"meta"}
    store = host_store(ours.model)
    assert {t.device.type for layer in store.flat for t in layer} == {"cpu"}
    for l in range(store.num_moe_layers):
        for e in range(store.layout.num_experts):
            for a, b in zip(expert_weights(ours.model, l, e), expert_weights(ref, l, e)):
                assert torch.equal(a, b)
    names = {n for f in folder.glob("*.safetensors") for n in header(f)}
    place = ours.placed
    assert set(place.host_names) == {n for n in names if is_routed_expert(n)}
    assert set(place.device_names) == {n for n in names if not is_routed_expert(n)}
    assert not place.skipped
    b = checkpoint_bytes(folder, element_size=4)
    assert place.host_bytes == b.expert_bytes
    buffers = sum(t.numel() * t.element_size() for t in ref.buffers())
    assert place.device_bytes == b.non_expert_bytes + buffers


def test_a_second_instance_loads_no_expert(hub_folder):
    folder = hub_folder("qwen")
    ours = load_model(ModelConfig(name="qwen", source="hf", path=str(folder)), CPU,
                              progress=False, plan=PlacementPlan("none"))
    assert host_store(ours.model) is None and not ours.placed.host_names
    assert set(ours.placed.skipped) == {n for f in folder.glob("*.safetensors")
                                           for n in header(f) if is_routed_expert(n)}


def test_a_checkpoint_missing_an_expert_is_one_sentence(hub_folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = hub_folder("olmoe")
    folder = tmp_path / "olmoe"
    shutil.copytree(src, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    gone = next(n for n in index["weight_map"] if n.endswith("experts.3.up_proj.weight"))
    shard = folder / index["weight_map"][gone]
    tensors = load_file(str(shard))
    del tensors[gone]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"has no up weights for routed expert 3 of MoE layer "):
        load_model(ModelConfig(name="olmoe", source="hf", path=str(folder)), CPU,
                           progress=False, plan=PlacementPlan("host"))


@pytest.fixture
def small_published(monkeypatch):
    """PUBLISHED["olmoe"] cut to 2 layers of narrowed widths (what `model.weights=random`
    builds from), so a random-weights run fits a CI machine."""
    import hub_fixtures

    from specter.models import published

    small = dict(published.PUBLISHED["olmoe"],
                 config=hub_fixtures.fixture_config("olmoe", 2, hub_fixtures.NARROW["olmoe"]))
    monkeypatch.setitem(published.PUBLISHED, "olmoe", small)
    return small


def test_random_weights_run_every_system_as_plain_generate(small_published, tmp_path):
    """`model.weights=random`: no checkpoint, the published config's model made at load with
    the same values wherever its experts go (the host store for lru and specter, the device
    for resident and the reference); each system's tokens equal plain `generate` on the
    reference; rows say weights=random; the device received only the non-expert weights."""
    import yaml

    from conftest import REPO
    from experiments import records, runner
    from specter.config import RunConfig
    from test_offload import A100

    mcfg = ModelConfig(name="olmoe", source="hf", weights="random")
    ref = load_model(mcfg, CPU, tmp_path / "cache", progress=False, plan=PlacementPlan("device"))
    assert not list(ref.checkpoint.glob("*.safetensors"))  # nothing on disk but configs
    ref.model.config._experts_implementation = "eager"
    again = load_model(mcfg, CPU, tmp_path / "cache", progress=False, plan=PlacementPlan("host"))
    for l in range(again.spec.num_moe_layers):
        for e in range(again.spec.num_experts):
            assert all(torch.equal(a, b) for a, b in zip(expert_weights(again.model, l, e),
                                                         expert_weights(ref.model, l, e)))
    model_yaml = yaml.safe_load((REPO / "conf" / "model" / "olmoe.yaml").read_text())
    for system in ("resident", "lru", "specter"):
        out = tmp_path / system
        cfg = RunConfig.from_dict({
            "model": {**model_yaml, "weights": "random"},
            "budget": {"name": "high", "slots": ref.spec.top_k + 1},
            "system": {"name": system}, "dataset": {"name": "gsm8k"},
            "hardware": {**A100, "charge": "own"},
            "workload": {"items": 2, "max_new_tokens": 6, "repeats": 1, "stop_on_eos": False},
            "quant": {"calib_tokens": 256}, "spec": {"k": 3}, "out_dir": str(out),
            "cache_dir": str(tmp_path / "cache"), "progress": False})
        runner.run(cfg, log=lambda *_: None)
        df = records.load(out)
        assert set(df["weights"]) == {"random"} and len(df) == 2
        row = df.iloc[0]
        if system != "resident":
            assert row["load_peak_device_bytes"] < row["ckpt_non_expert_bytes"] + 2**20
        for _, row in df.iterrows():
            ids = torch.tensor([list(row["prompt_tokens"])])
            want = ref.model.generate(ids, max_new_tokens=6, do_sample=False,
                                      pad_token_id=ref.tokenizer.pad_token_id or 0,
                                      eos_token_id=None)
            assert list(row["output_tokens"]) == want[0, ids.shape[1]:].tolist(), system


def test_random_weights_refusals_are_one_sentence():
    from specter.config import RunConfig
    from test_config import _with

    d = _with("model.weights", "zeros", None)
    d["model"] = {"name": "olmoe", "source": "hf", "weights": "zeros"}
    with pytest.raises(UserError, match="model.weights must be checkpoint, random or inflated"):
        RunConfig.from_dict(d)
    d["model"] = {"name": "tiny_olmoe", "source": "project", "weights": "random"}
    with pytest.raises(UserError, match="is project-made"):
        RunConfig.from_dict(d)
    with pytest.raises(UserError, match="does not hold; it holds deepseek"):
        loading.random_folder(ModelConfig(name="grok", source="hf", weights="random"), None)


def test_an_offloaded_cpu_run_its_memory_cannot_hold_is_one_sentence():
    """On the CPU the store, the slots and the rest share one memory: refused before loading
    when they cannot fit beside the process (the numbers of OLMoE-1B-7B in bf16, 53 slots)."""
    from specter.placement.bytes import CheckpointBytes, check_cpu_offload_fits

    GiB = 2**30
    b = CheckpointBytes(expert_bytes=12 * GiB, non_expert_bytes=GiB, tensors=0, expert_tensors=0)
    with pytest.raises(UserError, match=r"needs 23.9 GiB of memory .* 53 slots/layer .* this "
                                        r"process can have 23.5 GiB: lower the budget\.$") as err:
        check_cpu_offload_fits("olmoe", b, 53, 64, host_bytes=int(23.5 * GiB))
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"or load in bfloat16"):
        check_cpu_offload_fits("olmoe", b, 53, 64, host_bytes=int(23.5 * GiB), fp32=True)
    check_cpu_offload_fits("olmoe", b, 8, 64, host_bytes=int(23.5 * GiB))  # 8 slots fit
