"""Architecture configs of the real models (public config.json values), for charging their
sizes in the cost model without their weights. Loading real weights does not use these."""

from __future__ import annotations

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
}
