"""Checkpoint folders laid out as the public Hugging Face hub repositories of seven MoE models.

Test fixtures only: random weights, few layers, optionally narrowed widths. Written from the
published ``config.json`` values (``specter.models.published``, which also writes the config,
generation config and tokenizer files) and from the tensor names the hub checkpoints use, not
from the project's own model builder (``specter.models.zoo`` / ``archs`` are not imported).

The on-disk tensor names are the ORIGINAL per-expert names (``mlp.experts.E.gate_proj.weight``,
``block_sparse_moe.experts.E.w1.weight``, ...); transformers 5.24 fuses them into
``experts.gate_up_proj`` / ``experts.down_proj`` on load through ``conversion_mapping.py``
(qwen2_moe's pattern for deepseek_v2, glm4_moe_lite, qwen3_moe, olmoe; mixtral's and phimoe's
renames of ``block_sparse_moe`` to ``mlp``, phimoe also ``gate`` to ``router``).

Public API:
    PUBLISHED[key]    -> {"repo", "source", "unconfirmed", "config"} (config as shipped)
    NARROW[key]       -> width overrides for fast tests (expert counts and top-k kept)
    fixture_config(key, layers=2, narrow=None) -> the config.json dict write_fixture writes
    tensor_shapes(key, config) -> {name: (shape, dtype)} in checkpoint order
    expected_tensor_names(key, config) -> set of names
    write_fixture(key, out_dir, layers=2, narrow=None, seed=0) -> Path

Where the sources below disagree or are silent, the value is marked "unconfirmed".
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

from specter.models.published import KEYS, PUBLISHED, fixture_config, write_config_folder  # noqa: F401

# Width overrides for fast tests. Expert counts and top-k stay as published; the ratios that
# shape each attention (GQA groups, MLA nope:rope:v) are kept roughly as published.
NARROW: dict[str, dict] = {
    "deepseek": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                 "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
                 "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                 "v_head_dim": 16},
    "phi": {"hidden_size": 64, "intermediate_size": 64, "vocab_size": 512,
            "num_attention_heads": 4, "num_key_value_heads": 1},
    "qwen": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 128, "vocab_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 4},
    "mixtral": {"hidden_size": 64, "intermediate_size": 64, "vocab_size": 512,
                "num_attention_heads": 8, "num_key_value_heads": 2},
    "qwen3": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "vocab_size": 512, "num_attention_heads": 8, "num_key_value_heads": 1,
              "head_dim": 16},
    "olmoe": {"hidden_size": 64, "intermediate_size": 32, "vocab_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 4},
    "glm": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
            "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 24,
            "qk_rope_head_dim": 8, "v_head_dim": 32},
}

_MLA = ("deepseek", "glm")


# ------------------------------------------------------------------------------------------
# Tensor names and shapes (the hub checkpoints' original layout)
# ------------------------------------------------------------------------------------------

BF16, F32 = "bfloat16", "float32"


def _mlp(out: dict, p: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    out[f"{p}.{gate}.weight"] = ((inter, hidden), BF16)
    out[f"{p}.{up}.weight"] = ((inter, hidden), BF16)
    out[f"{p}.{down}.weight"] = ((hidden, inter), BF16)


def _gqa_attention(out: dict, p: str, c: dict, head_dim: int, qkv_bias: bool, o_bias: bool):
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim),
                       ("v_proj", kv * head_dim)):
        out[f"{p}.{name}.weight"] = ((rows, hidden), BF16)
        if qkv_bias:
            out[f"{p}.{name}.bias"] = ((rows,), BF16)
    out[f"{p}.o_proj.weight"] = ((hidden, heads * head_dim), BF16)
    if o_bias:
        out[f"{p}.o_proj.bias"] = ((hidden,), BF16)


def _mla_attention(out: dict, p: str, c: dict):
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    rank, q_rank = c["kv_lora_rank"], c.get("q_lora_rank")
    bias = bool(c.get("attention_bias"))
    if q_rank is None:
        out[f"{p}.q_proj.weight"] = ((heads * (nope + rope), hidden), BF16)
    else:
        out[f"{p}.q_a_proj.weight"] = ((q_rank, hidden), BF16)
        if bias:
            out[f"{p}.q_a_proj.bias"] = ((q_rank,), BF16)
        out[f"{p}.q_a_layernorm.weight"] = ((q_rank,), BF16)
        out[f"{p}.q_b_proj.weight"] = ((heads * (nope + rope), q_rank), BF16)
    out[f"{p}.kv_a_proj_with_mqa.weight"] = ((rank + rope, hidden), BF16)
    if bias:
        out[f"{p}.kv_a_proj_with_mqa.bias"] = ((rank + rope,), BF16)
    out[f"{p}.kv_a_layernorm.weight"] = ((rank,), BF16)
    out[f"{p}.kv_b_proj.weight"] = ((heads * (nope + v), rank), BF16)
    out[f"{p}.o_proj.weight"] = ((hidden, heads * v), BF16)
    if bias:
        out[f"{p}.o_proj.bias"] = ((hidden,), BF16)


def _is_sparse_qwen(c: dict, i: int) -> bool:
    return (i not in c.get("mlp_only_layers", [])) and c["num_experts"] > 0 \
        and (i + 1) % c.get("decoder_sparse_step", 1) == 0


def _layer(out: dict, key: str, c: dict, i: int):
    p = f"model.layers.{i}"
    hidden = c["hidden_size"]
    if key == "phi":  # LayerNorm (weight + bias) and biased q/k/v/o
        out[f"{p}.input_layernorm.weight"] = ((hidden,), BF16)
        out[f"{p}.input_layernorm.bias"] = ((hidden,), BF16)
    else:
        out[f"{p}.input_layernorm.weight"] = ((hidden,), BF16)

    if key in _MLA:
        _mla_attention(out, f"{p}.self_attn", c)
    elif key == "phi":
        bias = bool(c["attention_bias"])
        _gqa_attention(out, f"{p}.self_attn", c, hidden // c["num_attention_heads"], bias, bias)
    elif key == "qwen":  # Qwen2MoeConfig.qkv_bias defaults True; o_proj has no bias
        _gqa_attention(out, f"{p}.self_attn", c, hidden // c["num_attention_heads"], True, False)
    elif key == "mixtral":
        _gqa_attention(out, f"{p}.self_attn", c, hidden // c["num_attention_heads"], False, False)
    elif key == "qwen3":
        hd = c["head_dim"]
        bias = bool(c.get("attention_bias"))
        _gqa_attention(out, f"{p}.self_attn", c, hd, bias, bias)
        out[f"{p}.self_attn.q_norm.weight"] = ((hd,), BF16)  # per head
        out[f"{p}.self_attn.k_norm.weight"] = ((hd,), BF16)
    elif key == "olmoe":
        hd = hidden // c["num_attention_heads"]
        bias = bool(c.get("attention_bias"))
        _gqa_attention(out, f"{p}.self_attn", c, hd, bias, bias)
        out[f"{p}.self_attn.q_norm.weight"] = ((hidden,), BF16)  # over all heads
        out[f"{p}.self_attn.k_norm.weight"] = ((hd * c["num_key_value_heads"],), BF16)

    if key == "phi":
        out[f"{p}.post_attention_layernorm.weight"] = ((hidden,), BF16)
        out[f"{p}.post_attention_layernorm.bias"] = ((hidden,), BF16)
    else:
        out[f"{p}.post_attention_layernorm.weight"] = ((hidden,), BF16)

    if key in _MLA:
        freq = c.get("moe_layer_freq", 1)
        sparse = c.get("n_routed_experts") and i >= c["first_k_dense_replace"] and i % freq == 0
        if not sparse:
            _mlp(out, f"{p}.mlp", hidden, c["intermediate_size"])
            return
        experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        out[f"{p}.mlp.gate.weight"] = ((experts, hidden), BF16)
        if key == "glm":  # noaux_tc routing: the router's correction-bias buffer is saved
            out[f"{p}.mlp.gate.e_score_correction_bias"] = ((experts,), F32)
        for e in range(experts):
            _mlp(out, f"{p}.mlp.experts.{e}", hidden, inter)
        _mlp(out, f"{p}.mlp.shared_experts", hidden, inter * c["n_shared_experts"])
    elif key in ("phi", "mixtral"):
        experts, inter = c["num_local_experts"], c["intermediate_size"]
        out[f"{p}.block_sparse_moe.gate.weight"] = ((experts, hidden), BF16)
        for e in range(experts):
            _mlp(out, f"{p}.block_sparse_moe.experts.{e}", hidden, inter, ("w1", "w3", "w2"))
    else:  # qwen, qwen3, olmoe: mlp.gate + mlp.experts.E.{gate,up,down}_proj
        if key in ("qwen", "qwen3") and not _is_sparse_qwen(c, i):
            _mlp(out, f"{p}.mlp", hidden, c["intermediate_size"])
            return
        experts = c["num_experts"]
        inter = c["moe_intermediate_size"] if key != "olmoe" else c["intermediate_size"]
        out[f"{p}.mlp.gate.weight"] = ((experts, hidden), BF16)
        for e in range(experts):
            _mlp(out, f"{p}.mlp.experts.{e}", hidden, inter)
        if key == "qwen":
            _mlp(out, f"{p}.mlp.shared_expert", hidden, c["shared_expert_intermediate_size"])
            out[f"{p}.mlp.shared_expert_gate.weight"] = ((1, hidden), BF16)


def tensor_shapes(key: str, config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor the hub checkpoint holds for `config`."""
    if key not in PUBLISHED:
        raise KeyError(f"unknown hub fixture {key!r}")
    c = config
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    out["model.embed_tokens.weight"] = ((vocab, hidden), BF16)
    for i in range(c["num_hidden_layers"]):
        _layer(out, key, c, i)
    out["model.norm.weight"] = ((hidden,), BF16)
    if key == "phi":
        out["model.norm.bias"] = ((hidden,), BF16)
    if not c.get("tie_word_embeddings", False):
        out["lm_head.weight"] = ((vocab, hidden), BF16)
    if key == "phi" and c.get("lm_head_bias"):
        out["lm_head.bias"] = ((vocab,), BF16)
    return out


def expected_tensor_names(key: str, config: dict) -> set[str]:
    return set(tensor_shapes(key, config))


def parameter_count(key: str, config: dict) -> tuple[int, int]:
    """(elements, bytes on disk) of the checkpoint `config` implies."""
    elements = nbytes = 0
    for shape, dtype in tensor_shapes(key, config).values():
        n = math.prod(shape)
        elements += n
        nbytes += n * (4 if dtype == F32 else 2)
    return elements, nbytes


# ------------------------------------------------------------------------------------------
# Writing a fixture
# ------------------------------------------------------------------------------------------

_STD = 0.02
_CHUNK = 1 << 22  # elements generated at a time, so real-width tensors need little scratch


def _is_norm_weight(name: str) -> bool:
    return name.endswith("norm.weight")  # input/post_attention/q_a/kv_a/q/k/model norms


def _is_norm_bias(name: str) -> bool:
    return name.endswith("norm.bias")  # Phi's LayerNorm biases


def _random_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    torch_dtype = torch.float32 if dtype == F32 else torch.bfloat16
    if _is_norm_weight(name):
        return torch.ones(shape, dtype=torch_dtype)
    if _is_norm_bias(name):
        return torch.zeros(shape, dtype=torch_dtype)
    # One generator per tensor, seeded from (seed, name): a tensor's values do not depend on
    # which shard it lands in or on which other tensors exist.
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    out = torch.empty(shape, dtype=torch_dtype)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        flat[start:start + n] = torch.randn(n, generator=g, dtype=torch.float32).mul_(_STD)
    return out


def _split_two(names: list[str], sizes: dict[str, int]) -> list[list[str]]:
    """Checkpoint order, cut where the first shard reaches half the bytes (both non-empty)."""
    total, acc = sum(sizes.values()), 0
    for cut, name in enumerate(names):
        if acc + sizes[name] > total / 2 and cut > 0:
            break
        acc += sizes[name]
    else:
        cut = len(names) - 1
    cut = min(max(cut, 1), len(names) - 1)
    return [names[:cut], names[cut:]]


def write_fixture(key: str, out_dir, layers: int = 2, narrow: dict | None = None,
                  seed: int = 0) -> Path:
    """Write a checkpoint folder laid out as `key`'s hub repository; return its path.

    config.json (published values, `layers` deep, `narrow` widths), generation_config.json,
    tokenizer.json + tokenizer_config.json, and bf16 random weights (norms 1, LayerNorm
    biases 0, the rest N(0, 0.02); GLM's e_score_correction_bias F32) in two safetensors
    shards model-0000{1,2}-of-00002.safetensors with model.safetensors.index.json.
    """
    from safetensors.torch import save_file

    config = fixture_config(key, layers, narrow)
    out = write_config_folder(key, out_dir, layers, narrow)

    shapes = tensor_shapes(key, config)
    names = list(shapes)
    sizes = {n: math.prod(s) * (4 if d == F32 else 2) for n, (s, d) in shapes.items()}
    shards = _split_two(names, sizes)
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n][0], shapes[n][1], seed) for n in shard}
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        (out / filename).chmod(0o644)
        del tensors
        weight_map.update({n: filename for n in shard})
    index_json = {"metadata": {"total_size": sum(sizes.values())},
                  "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return out
