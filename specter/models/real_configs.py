"""Architecture configs of the real models (public config.json values), for charging their
sizes in the cost model without their weights. Loading real weights does not use these.
The paper's three models come first (`PAPER_MODELS`); Mixtral-8x7B, Qwen3-30B-A3B, OLMoE and
GLM-4.7-Flash follow, their values from public copies of each hub repository's config.json
(tests/hub_fixtures.py names the copies)."""

from __future__ import annotations

PAPER_MODELS = ("deepseek", "qwen", "phi")  # the Specter paper's models, in its order

REAL_CONFIGS: dict[str, dict] = {
    "deepseek": {  # deepseek-ai/DeepSeek-V2-Lite
        "_name_or_path": "deepseek-ai/DeepSeek-V2-Lite", "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
    },
    "qwen": {  # Qwen/Qwen1.5-MoE-A2.7B
        "_name_or_path": "Qwen/Qwen1.5-MoE-A2.7B", "model_type": "qwen2_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
        "norm_topk_prob": False, "tie_word_embeddings": False,
    },
    "phi": {  # microsoft/Phi-3.5-MoE-instruct
        "_name_or_path": "microsoft/Phi-3.5-MoE-instruct", "model_type": "phimoe",
        "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 16, "num_experts_per_tok": 2, "attention_bias": True,
        "lm_head_bias": True, "tie_word_embeddings": False,
    },
    "mixtral": {  # mistralai/Mixtral-8x7B-v0.1
        "_name_or_path": "mistralai/Mixtral-8x7B-v0.1", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32000,
    },
    "qwen3": {  # Qwen/Qwen3-30B-A3B
        "_name_or_path": "Qwen/Qwen3-30B-A3B", "attention_bias": False,
        "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "olmoe": {  # allenai/OLMoE-1B-7B-0924
        "_name_or_path": "allenai/OLMoE-1B-7B-0924", "attention_bias": False, "clip_qkv": None,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024,
        "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "vocab_size": 50304,
    },
    "glm": {  # zai-org/GLM-4.7-Flash
        "_name_or_path": "zai-org/GLM-4.7-Flash", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 10240, "max_position_embeddings": 202752,
        "model_type": "glm4_moe_lite", "moe_intermediate_size": 1536, "topk_method": "noaux_tc",
        "norm_topk_prob": True, "num_attention_heads": 20, "n_group": 1, "topk_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
        "num_experts_per_tok": 4, "first_k_dense_replace": 1, "num_hidden_layers": 47,
        "num_key_value_heads": 20, "num_nextn_predict_layers": 1, "partial_rotary_factor": 1.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
        "tie_word_embeddings": False, "q_lora_rank": 768, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "vocab_size": 154880,
    },
}
