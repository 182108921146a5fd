"""Architecture configs of the real models (public config.json values), for charging their
sizes in the cost model without their weights. Loading real weights does not use these.
The paper's three models come first (`PAPER_MODELS`); Mixtral-8x7B, Qwen3-30B-A3B, OLMoE and
GLM-4.7-Flash follow.

Owns: which fields of each real model's config.json the cost model builds its meta-device
model from (`CHARGED_FIELDS`). The values are not repeated here: `REAL_CONFIGS` takes them from
specter/models/published.py `PUBLISHED` (each hub repository's config.json, with its sources;
tests/hub_fixtures.py builds its checkpoint folders from the same table), `_name_or_path`
being the hub repository.
"""

from __future__ import annotations

import copy

from specter.models.published import PUBLISHED

PAPER_MODELS = ("deepseek", "qwen", "phi")  # the Specter paper's models, in its order

# The config.json fields each model's meta-device build needs (its sizes and its shapes), in
# the order the configs are written.
CHARGED_FIELDS: dict[str, tuple[str, ...]] = {
    "deepseek": (  # deepseek-ai/DeepSeek-V2-Lite
        "model_type", "vocab_size", "hidden_size", "intermediate_size",
        "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "n_shared_experts", "n_routed_experts",
        "num_experts_per_tok", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "topk_method", "n_group",
        "topk_group", "norm_topk_prob", "routed_scaling_factor", "tie_word_embeddings",
    ),
    "qwen": (  # Qwen/Qwen1.5-MoE-A2.7B
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "moe_intermediate_size",
        "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
        "decoder_sparse_step", "norm_topk_prob", "tie_word_embeddings",
    ),
    "phi": (  # microsoft/Phi-3.5-MoE-instruct
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "num_local_experts",
        "num_experts_per_tok", "attention_bias", "lm_head_bias", "tie_word_embeddings",
    ),
    "mixtral": (  # mistralai/Mixtral-8x7B-v0.1
        "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
        "model_type", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
        "num_key_value_heads", "num_local_experts", "rms_norm_eps", "rope_theta",
        "sliding_window", "tie_word_embeddings", "vocab_size",
    ),
    "qwen3": (  # Qwen/Qwen3-30B-A3B
        "attention_bias", "decoder_sparse_step", "head_dim", "hidden_act", "hidden_size",
        "intermediate_size", "max_position_embeddings", "max_window_layers",
        "mlp_only_layers", "model_type", "moe_intermediate_size", "norm_topk_prob",
        "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
        "num_key_value_heads", "rms_norm_eps", "rope_scaling", "rope_theta",
        "sliding_window", "tie_word_embeddings", "use_sliding_window", "vocab_size",
    ),
    "olmoe": (  # allenai/OLMoE-1B-7B-0924
        "attention_bias", "clip_qkv", "hidden_act", "hidden_size", "intermediate_size",
        "max_position_embeddings", "model_type", "norm_topk_prob", "num_attention_heads",
        "num_experts", "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
        "rms_norm_eps", "rope_scaling", "rope_theta", "tie_word_embeddings", "vocab_size",
    ),
    "glm": (  # zai-org/GLM-4.7-Flash
        "attention_bias", "hidden_act", "hidden_size", "intermediate_size",
        "max_position_embeddings", "model_type", "moe_intermediate_size", "topk_method",
        "norm_topk_prob", "num_attention_heads", "n_group", "topk_group",
        "n_routed_experts", "n_shared_experts", "routed_scaling_factor",
        "num_experts_per_tok", "first_k_dense_replace", "num_hidden_layers",
        "num_key_value_heads", "num_nextn_predict_layers", "partial_rotary_factor",
        "rms_norm_eps", "rope_scaling", "rope_theta", "tie_word_embeddings", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size",
    ),
}


def _real_config(key: str, fields: tuple[str, ...]) -> dict:
    published = PUBLISHED[key]
    return {"_name_or_path": published["repo"],
            **{f: copy.deepcopy(published["config"][f]) for f in fields}}


REAL_CONFIGS: dict[str, dict] = {key: _real_config(key, fields)
                                 for key, fields in CHARGED_FIELDS.items()}
