"""The public config.json of each real model the project names, as its hub repository ships it
(`auto_map` included where the hub has one), with the sources each value was read from, and
the non-weight files of a checkpoint folder in that layout: config.json (optionally cut in
depth and narrowed), generation_config.json and a tokenizer holding the model's special tokens
at their published ids.

Used by `model.weights=random` (a named real model at its real sizes with random weights and
no download: placement/loader.py), by the test suite's hub-layout fixtures
(tests/hub_fixtures.py adds the weights), and by specter/models/real_configs.py, whose
`REAL_CONFIGS` (the fields the cost model charges) takes its values from here. Where the
sources disagree or are silent, a value is marked "unconfirmed".

    PUBLISHED[key]  -> {"repo", "source", "unconfirmed", "config"}
    fixture_config(key, layers=None, narrow=None) -> the config.json dict
    write_config_folder(key, out, layers=None, narrow=None) -> Path (no weights)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

KEYS = ("deepseek", "phi", "qwen", "mixtral", "qwen3", "olmoe", "glm")


# ------------------------------------------------------------------------------------------
# Published config.json values
# ------------------------------------------------------------------------------------------

# Phi-3.5-MoE longrope factors (64 = head_dim 128 / 2 each). Source: MindSpeed-LLM
# examples/mcore/phi35/pretrain_phi35_moe_ptd.sh (LONG_FACTOR / SHORT_FACTOR, copied from the
# hub config); first 8 values cross-checked against EasyDeL's test_phimoe (rope_scaling of
# microsoft/Phi-3.5-MoE-instruct) and the 64-element length / first values / mscale against a
# Go test of testdata/phimoe.json (long_factor[0]=1.0199999809265137, short_factor[0]=1.0).
_PHI_LONG_FACTOR = [
    1.0199999809265137, 1.0299999713897705, 1.0399999618530273, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.059999942779541, 1.059999942779541,
    1.059999942779541, 1.059999942779541, 1.059999942779541, 1.059999942779541,
    1.0999999046325684, 1.1799999475479126, 1.1799999475479126, 1.3700000047683716,
    1.4899998903274536, 2.109999895095825, 2.8899998664855957, 3.9499998092651367,
    4.299999713897705, 6.429999828338623, 8.09000015258789, 10.690000534057617,
    12.050000190734863, 18.229999542236328, 18.84000015258789, 19.899999618530273,
    21.420000076293945, 26.200000762939453, 34.28000259399414, 34.590003967285156,
    38.730003356933594, 40.22000503540039, 42.54000473022461, 44.000003814697266,
    47.590003967285156, 54.750003814697266, 56.19000244140625, 57.44000244140625,
    57.4900016784668, 61.20000076293945, 61.540000915527344, 61.75, 61.779998779296875,
    62.06999969482422, 63.11000061035156, 63.43000030517578, 63.560001373291016,
    63.71000289916992, 63.92000198364258, 63.94000244140625, 63.94000244140625,
    63.96000289916992, 63.980003356933594, 64.0300064086914, 64.0300064086914,
    64.0300064086914, 64.04000854492188, 64.10000610351562, 64.19000244140625,
    64.20999908447266, 64.75, 64.95999908447266,
]
_PHI_SHORT_FACTOR = [
    1.0, 1.0399999618530273, 1.0399999618530273, 1.0399999618530273, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.059999942779541, 1.059999942779541, 1.0699999332427979,
    1.0699999332427979, 1.0699999332427979, 1.0699999332427979, 1.1399999856948853,
    1.159999966621399, 1.159999966621399, 1.159999966621399, 1.159999966621399,
    1.1799999475479126, 1.1999999284744263, 1.3199999332427979, 1.3399999141693115,
    1.3499999046325684, 1.3999998569488525, 1.4799998998641968, 1.4999998807907104,
    1.589999794960022, 1.6499998569488525, 1.71999990940094, 1.8999998569488525,
    1.9099998474121094, 1.9099998474121094, 1.9899998903274536, 1.9999998807907104,
    1.9999998807907104, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.009999990463257, 2.009999990463257,
    2.009999990463257, 2.009999990463257, 2.0999999046325684, 2.319999933242798,
    2.419999837875366, 2.5899999141693115, 2.7899999618530273,
]

PUBLISHED: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V2-Lite. Sources: (1) a transformers log of the
    # DeepSeek-V2-Lite-Chat snapshot's config.json (DeepseekV2Config dump: every value below,
    # auto_map included); (2) a C++ test kDeepSeekV2Lite ("the checkpoint's config, verbatim
    # except for HF bookkeeping keys"): every architectural value agrees; (3) murillo128/
    # llm-model-explorer's pinned-config fixture notes: base config transformers_version 4.33.1,
    # no ep_size, 5,291 tensors (layer 0 dense, 26 MoE layers x 64 experts, q_proj direct since
    # q_lora_rank is null). pretraining_tp (present in the V2 236B config) is unconfirmed for
    # the Lite base.
    "deepseek": {
        "repo": "deepseek-ai/DeepSeek-V2-Lite",
        "source": "DeepSeek-V2-Lite-Chat config dump (transformers log); C++ kDeepSeekV2Lite test "
                  "fixture; llm-model-explorer deepseek-v2-lite-reference fixture notes",
        "unconfirmed": ["pretraining_tp", "transformers_version", "ep_size (assumed absent)"],
        "config": {
            "architectures": ["DeepseekV2ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_deepseek.DeepseekV2Config",
                "AutoModel": "modeling_deepseek.DeepseekV2Model",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
            },
            "aux_loss_alpha": 0.001,
            "bos_token_id": 100000,
            "eos_token_id": 100001,
            "first_k_dense_replace": 1,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 10944,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163840,
            "model_type": "deepseek_v2",
            "moe_intermediate_size": 1408,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 27,
            "num_key_value_heads": 16,
            "pretraining_tp": 1,  # unconfirmed for the Lite base
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 10000,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "greedy",
            "torch_dtype": "bfloat16",
            "transformers_version": "4.33.1",  # unconfirmed (llm-model-explorer fixture)
            "use_cache": True,
            "v_head_dim": 128,
            "vocab_size": 102400,
        },
    },
    # microsoft/Phi-3.5-MoE-instruct. Sources: xinyuwei-david "Phi-3.5-MoE-and-Mini-Fine-tuning"
    # (field-by-field listing of the hub config.json, auto_map, bos/eos, transformers 4.43.3);
    # a Go test of testdata/phimoe.json (auto_map, sliding_window 131072, rope_theta, mscale
    # 1.243163121016122, 64-long factor lists, lm_head_bias, input_jitter_noise 0.01,
    # router_aux_loss_coef 0.0, torch_dtype bfloat16, transformers 4.43.3); mlx-lm's phimoe
    # test config. rope factor lists: MindSpeed-LLM (see above). use_cache is unconfirmed.
    "phi": {
        "repo": "microsoft/Phi-3.5-MoE-instruct",
        "source": "Phi-3.5-MoE-and-Mini-Fine-tuning config listing; Go phimoe.json test; "
                  "MindSpeed-LLM pretrain_phi35_moe_ptd.sh (factor lists); EasyDeL test_phimoe",
        "unconfirmed": ["use_cache", "_name_or_path (omitted)"],
        "config": {
            "architectures": ["PhiMoEForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "auto_map": {
                "AutoConfig": "configuration_phimoe.PhiMoEConfig",
                "AutoModelForCausalLM": "modeling_phimoe.PhiMoEForCausalLM",
            },
            "bos_token_id": 1,
            "eos_token_id": 32000,
            "hidden_act": "silu",
            "hidden_dropout": 0.0,
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "input_jitter_noise": 0.01,
            "intermediate_size": 6400,
            "lm_head_bias": True,
            "max_position_embeddings": 131072,
            "model_type": "phimoe",
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 16,
            "original_max_position_embeddings": 4096,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "long_factor": _PHI_LONG_FACTOR,
                "long_mscale": 1.243163121016122,
                "original_max_position_embeddings": 4096,
                "short_factor": _PHI_SHORT_FACTOR,
                "short_mscale": 1.243163121016122,
                "type": "longrope",
            },
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.0,
            "router_jitter_noise": 0.01,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.43.3",
            "use_cache": True,  # unconfirmed
            "vocab_size": 32064,
        },
    },
    # Qwen/Qwen1.5-MoE-A2.7B. Sources: the Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 config.json (full
    # key set, transformers 4.39.0.dev0); a C# HfConfigExtractor test of the Qwen1.5-MoE-A2.7B
    # config (max_position_embeddings 8192, norm_topk_prob false, decoder_sparse_step 1);
    # several planners' copies (60 experts, top-4, 1408 / 5632). The base model's eos id
    # (151643, vs the Chat model's 151645), bos id and torch_dtype are unconfirmed.
    "qwen": {
        "repo": "Qwen/Qwen1.5-MoE-A2.7B",
        "source": "Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 config.json (key set); C# "
                  "Qwen15Moe_A27B test (base values); vLLM/SGLang planner copies",
        "unconfirmed": ["bos_token_id", "eos_token_id", "torch_dtype", "transformers_version"],
        "config": {
            "architectures": ["Qwen2MoeForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 5632,
            "max_position_embeddings": 8192,
            "max_window_layers": 21,
            "model_type": "qwen2_moe",
            "moe_intermediate_size": 1408,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_key_value_heads": 16,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 5632,
            "sliding_window": 32768,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.39.0.dev0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    },
    # mistralai/Mixtral-8x7B-v0.1. Sources: TensorRT-LLM's MIXTRAL_8X7B_CONFIG (test), a
    # verbatim config dump in a Chinese Mixtral walkthrough, llm-engine's _infer_hardware test:
    # all identical. No auto_map.
    "mixtral": {
        "repo": "mistralai/Mixtral-8x7B-v0.1",
        "source": "TensorRT-LLM tests MIXTRAL_8X7B_CONFIG; two further verbatim copies",
        "unconfirmed": [],
        "config": {
            "architectures": ["MixtralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mixtral",
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.36.0.dev0",
            "use_cache": True,
            "vocab_size": 32000,
        },
    },
    # Qwen/Qwen3-30B-A3B. Source: alibaba InferSim hf_configs/qwen3-30B-A3B_config.json (fork
    # roshini0108/InferSim), verbatim; values agree with slime's qwen3-30B-A3B.sh and several
    # planners (128 experts, top-8, 768, head_dim 128, 4 kv heads). No auto_map.
    "qwen3": {
        "repo": "Qwen/Qwen3-30B-A3B",
        "source": "InferSim hf_configs/qwen3-30B-A3B_config.json (verbatim copy)",
        "unconfirmed": [],
        "config": {
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "decoder_sparse_step": 1,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
    },
    # allenai/OLMoE-1B-7B-0924. Sources: an OLMoE HF-format config ("step23842-hf", same
    # architecture, full key set); a moe_engine test "fields of allenai/OLMoE-1B-7B-0924's
    # config.json"; zig/Python copies (eos 50279, pad 1, router_aux_loss_coef 0.01,
    # norm_topk_prob false, torch_dtype float32). torch_dtype float32 and transformers_version
    # are unconfirmed for this exact revision (the fixture writes bf16 weights regardless).
    "olmoe": {
        "repo": "allenai/OLMoE-1B-7B-0924",
        "source": "OLMoE step23842-hf config; moe_engine OLMOE_1B_7B_HF_CONFIG test; "
                  "verified-results planner test",
        "unconfirmed": ["torch_dtype (float32)", "transformers_version"],
        "config": {
            "architectures": ["OlmoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "clip_qkv": None,
            "eos_token_id": 50279,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 1024,
            "max_position_embeddings": 4096,
            "model_type": "olmoe",
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 16,
            "num_key_value_heads": 16,
            "output_router_logits": False,
            "pad_token_id": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",  # unconfirmed
            "transformers_version": "4.43.0.dev0",  # unconfirmed
            "use_cache": True,
            "vocab_size": 50304,
        },
    },
    # zai-org/GLM-4.7-Flash. Source: an sglang/ktransformers preflight test's
    # write_exact_glm_4_7_flash_config (written to match the snapshot's config sha256; key
    # order as shipped); every architectural value agrees with vLLM's
    # tests/.../test_glm4_moe_lite_config.py. No auto_map (native in transformers >= 5.0).
    # The hub checkpoint also holds the MTP layer model.layers.47.* (num_nextn_predict_layers
    # 1), which transformers ignores on load; fixtures set num_nextn_predict_layers 0 and write
    # no MTP layer.
    "glm": {
        "repo": "zai-org/GLM-4.7-Flash",
        "source": "sglang-kt preflight test make_glm_4_7_flash_bf16_config (exact copy); vLLM "
                  "glm4_moe_lite config test",
        "unconfirmed": ["dtype of mlp.gate.e_score_correction_bias on disk (F32 assumed)"],
        "config": {
            "architectures": ["Glm4MoeLiteForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "pad_token_id": 154820,
            "eos_token_id": [154820, 154827, 154829],
            "hidden_act": "silu",
            "hidden_size": 2048,
            "intermediate_size": 10240,
            "max_position_embeddings": 202752,
            "model_type": "glm4_moe_lite",
            "moe_intermediate_size": 1536,
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "num_attention_heads": 20,
            "n_group": 1,
            "topk_group": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.8,
            "num_experts_per_tok": 4,
            "first_k_dense_replace": 1,
            "num_hidden_layers": 47,
            "num_key_value_heads": 20,
            "num_nextn_predict_layers": 1,
            "partial_rotary_factor": 1.0,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "transformers_version": "5.0.0rc0",
            "q_lora_rank": 768,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 192,
            "qk_rope_head_dim": 64,
            "v_head_dim": 256,
            "vocab_size": 154880,
        },
    },
}

# Special tokens of each hub tokenizer, by their published id. The strings are the hub
# tokenizers' (the GLM role tokens and the Phi eos are from memory: unconfirmed); the ids
# follow the config. `bos_prepend`: the hub tokenizer adds BOS to every encoding.
_SPECIALS: dict[str, dict] = {
    "deepseek": {"tokens": {100000: "<｜begin▁of▁sentence｜>", 100001: "<｜end▁of▁sentence｜>"},
                 "bos": 100000, "eos": 100001, "pad": None, "unk": None, "bos_prepend": True},
    "phi": {"tokens": {0: "<unk>", 1: "<s>", 32000: "<|endoftext|>"},
            "bos": 1, "eos": 32000, "pad": None, "unk": 0, "bos_prepend": False},
    "qwen": {"tokens": {151643: "<|endoftext|>"},
             "bos": None, "eos": 151643, "pad": 151643, "unk": None, "bos_prepend": False},
    "mixtral": {"tokens": {0: "<unk>", 1: "<s>", 2: "</s>"},
                "bos": 1, "eos": 2, "pad": None, "unk": 0, "bos_prepend": True},
    "qwen3": {"tokens": {151643: "<|endoftext|>", 151645: "<|im_end|>"},
              "bos": None, "eos": 151645, "pad": 151643, "unk": None, "bos_prepend": False},
    "olmoe": {"tokens": {1: "<|padding|>", 50279: "<|endoftext|>"},
              "bos": None, "eos": 50279, "pad": 1, "unk": None, "bos_prepend": False},
    "glm": {"tokens": {154820: "<|endoftext|>", 154827: "<|user|>", 154829: "<|observation|>"},
            "bos": None, "eos": 154820, "pad": 154820, "unk": None, "bos_prepend": False},
}

_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# ------------------------------------------------------------------------------------------
# Config for a fixture: cut depth, optional narrowing
# ------------------------------------------------------------------------------------------

def _published_config(key: str) -> dict:
    if key not in PUBLISHED:
        raise KeyError(f"unknown hub fixture {key!r}; known: {', '.join(KEYS)}")
    return copy.deepcopy(PUBLISHED[key]["config"])


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _id_map(key: str, config: dict) -> dict[int, int]:
    """published token id -> fixture token id.

    Identity while the ids fit the (possibly narrowed) vocabulary. A narrowed vocabulary
    moves the special ids that no longer fit to the top of it (highest published id last),
    so an embedding's padding_idx, a tokenizer's BOS and generation's EOS stay in range.
    """
    vocab = config["vocab_size"]
    published = set(_SPECIALS[key]["tokens"])
    for field in _TOKEN_ID_FIELDS:
        published.update(_token_ids(PUBLISHED[key]["config"].get(field)))
    mapping = {i: i for i in published if i < vocab}
    top = vocab - 1
    for i in sorted(published, reverse=True):
        if i in mapping:
            continue
        while top in mapping.values():
            top -= 1
        if top < 0:
            raise ValueError(f"vocab_size {vocab} is too small for {key}'s special tokens")
        mapping[i] = top
        top -= 1
    return mapping


def _apply_narrow(key: str, config: dict, narrow: dict) -> None:
    unknown = set(narrow) - set(config) - {"head_dim"}
    if unknown:
        raise KeyError(f"narrow keys not in {key}'s config: {sorted(unknown)}")
    config.update(narrow)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of kv heads {kv}")
    if key == "qwen" and "shared_expert_intermediate_size" not in narrow \
            and "intermediate_size" in narrow:
        # published: shared expert as wide as the dense intermediate (5632 both)
        config["shared_expert_intermediate_size"] = config["intermediate_size"]
    if key == "qwen3" and "head_dim" not in narrow:
        config["head_dim"] = config["hidden_size"] // heads
    if key in ("phi", "mixtral", "qwen", "olmoe") and config["hidden_size"] % heads:
        raise ValueError(f"{key}: hidden_size must be a multiple of num_attention_heads")
    if key == "phi":
        # longrope: one short and one long factor per rotary frequency (head_dim / 2).
        # Subsample the published 64-entry lists evenly so the low->high profile is kept.
        half = config["hidden_size"] // heads // 2
        rope = config["rope_scaling"]
        for name in ("long_factor", "short_factor"):
            full = rope[name]
            rope[name] = [full[(i * len(full)) // half] for i in range(half)]
    # Token ids: keep them inside a narrowed vocabulary.
    mapping = _id_map(key, config)
    for field in _TOKEN_ID_FIELDS:
        if field in config and config[field] is not None:
            value = config[field]
            config[field] = ([mapping[i] for i in value] if isinstance(value, list)
                             else mapping[value])


def fixture_config(key: str, layers: int | None = None, narrow: dict | None = None) -> dict:
    """The config.json a folder carries: the published one (at its published depth when
    `layers` is None; else `layers` deep), maybe narrowed.

    Depth: num_hidden_layers = layers; a dense first layer stays dense (first_k_dense_replace
    is kept, so DeepSeek / GLM have layer 0 dense and layers 1.. MoE); per-layer lists
    (mlp_only_layers, layer_types, mlp_layer_types) are trimmed to the kept layers; MTP layers
    (num_nextn_predict_layers) are set to 0. Everything not named in `narrow` keeps its
    published value, except special token ids that a narrowed vocab_size cannot hold (moved to
    the top of the vocabulary; see _id_map).
    """
    config = _published_config(key)
    if layers is None:
        layers = config["num_hidden_layers"]
    if layers < 1:
        raise ValueError("layers must be >= 1")
    config["num_hidden_layers"] = layers
    if "mlp_only_layers" in config:
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    for name in ("layer_types", "mlp_layer_types"):
        if isinstance(config.get(name), list):
            config[name] = config[name][:layers]
    if "num_nextn_predict_layers" in config:
        config["num_nextn_predict_layers"] = 0
    if narrow:
        _apply_narrow(key, config, dict(narrow))
    return config


def _write_tokenizer(out: Path, key: str, config: dict, mapping: dict[int, int]) -> None:
    """A byte-level BPE without merges (every text encodes; no unknowns for ASCII/UTF-8 bytes)
    with the model's special tokens at the config's ids. It may hold fewer tokens than
    vocab_size, as the hub tokenizers of several of these models do too."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    spec = _SPECIALS[key]
    vocab_size = config["vocab_size"]
    special = {mapping[i]: text for i, text in spec["tokens"].items()}
    vocab: dict[str, int] = {text: i for i, text in special.items()}
    free = (i for i in range(vocab_size) if i not in special)
    if "<unk>" not in vocab:
        vocab["<unk>"] = next(free)
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    for char in byte_chars:
        i = next(free, None)
        if i is None:
            break
        vocab.setdefault(char, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [special[i] for i in sorted(special)]
    specials += [] if "<unk>" in specials else ["<unk>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def text(published_id):
        return None if published_id is None else spec["tokens"][published_id]

    bos, eos, pad = text(spec["bos"]), text(spec["eos"]), text(spec["pad"])
    unk = text(spec["unk"]) or "<unk>"
    if spec["bos_prepend"]:
        bos_id = mapping[spec["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "add_bos_token": bool(spec["bos_prepend"]), "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 4096),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _generation_config(config: dict) -> dict:
    gen = {"_from_model_config": True}
    for field in _TOKEN_ID_FIELDS:
        if config.get(field) is not None:
            gen[field] = config[field]
    gen["transformers_version"] = config.get("transformers_version", "")
    return gen




def write_config_folder(key: str, out_dir, layers: int | None = None,
                        narrow: dict | None = None) -> Path:
    """A checkpoint folder without weights in `key`'s hub layout: config.json (published
    values; `layers` deep, `narrow` widths when given), generation_config.json, tokenizer."""
    config = fixture_config(key, layers, narrow)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(_generation_config(config), indent=2) + "\n")
    _write_tokenizer(out, key, config, _id_map(key, config))
    return out
