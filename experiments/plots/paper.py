"""The Specter paper's numbers as data (docs/paper-notes.md), to put beside ours.

Every number here comes from the paper's single A100 40 GB machine (PCIe 4.0 x16); tables
show them in a "paper (A100)" column and figures as red diamonds. Keys: model families
(`cfg.model.stands_for` of the project-made models, or the real model's config name) and our
system names (conf/system/*.yaml).
"""

from __future__ import annotations

HARDWARE = "A100 40 GB, PCIe 4.0 x16 (31.5 GB/s)"
MODELS = {"deepseek": "DeepSeek-V2-Lite", "qwen": "Qwen1.5-MoE-A2.7B", "phi": "Phi-3.5-MoE"}

# Mean TPOT (ms) at the high budget (docs/paper-notes.md "Headline results"); the paper's vLLM
# (cpu_offload_gb) is our system=vllm_offload.
TPOT_HIGH_MS: dict[str, dict[str, float]] = {
    "qwen": {"specter": 35.3, "specmoeoff": 66.4, "mo_sm": 74.2, "vllm_offload": 176.6,
             "transformers": 258.2},
    "phi": {"specter": 163.3, "specmoeoff": 292.1, "mo_sm": 295.1, "vllm_offload": 297.5,
            "transformers": 960.6},
    "deepseek": {"specter": 72.2, "transformers": 344.9},
}
SPEEDUP_VS_SPECMOEOFF = {"mean": 1.50, "max": 1.88}

# Batch 32 on DeepSeek-V2-Lite: (TPOT ms, throughput tok/s); experiment=batch (plots/batch.py).
BATCH32_DEEPSEEK = {"specter": (119.2, 130.3), "specmoeoff": (718.0, 40.2),
                    "mo_sm": (1262.9, 25.3), "transformers": (1493.6, 21.4)}

# GPU memory of Qwen1.5-MoE at a 12K context: one shared instance vs two separate models.
MEMORY_QWEN_12K = {"context": 12288, "shared_GB": 7.68, "separate_GB": 13.40, "saving": 0.43}

# Hit rate of Specter on DeepSeek-V2-Lite at 16 / 24 / 32 GB; our budgets low / high / xhigh
# stand for them (conf/budget: xhigh is the 32 GB case; low is 18 GB in the main table).
HIT_RATE_DEEPSEEK = {"low": (16, 0.9985), "high": (24, 0.9862), "xhigh": (32, 0.9625)}

# Ablation, ms/token; keyed by (orchestrator, shared, reorder) as our switches read them.
ABLATION_MS = {(True, True, True): ("full", 69.2), (False, True, True): ("no PIO", 83.5),
               (False, False, True): ("no PIO+SIC", 94.4), (False, False, False): ("none", 130.4)}

# Fraction of H2D time hidden behind compute, Specter.
H2D_HIDDEN_FRAC = {"deepseek": 0.555, "qwen": 0.605, "phi": 0.224}

# Routing fidelity: top-k match of the INT4 draft's routing with the target's.
FIDELITY_GPTQ4 = {"phi": 0.9650, "deepseek": 0.9633, "qwen": 0.9082}
# (method, bits) -> top-k match on DeepSeek-V2-Lite; gptq 4 bit is FIDELITY_GPTQ4's.
FIDELITY_METHODS_DEEPSEEK = {("gguf", 2): 0.9296, ("gguf", 4): 0.9653, ("gguf", 8): 0.9938,
                             ("awq", 4): 0.9572, ("gptq", 4): 0.9633}
# Our methods that are the paper's GPTQ (the built-in one and gptqmodel's).
GPTQ_METHODS = ("gptq", "gptqmodel")

# Expert explosion: distinct experts per layer needed by K consecutive tokens, K = 1 -> 16.
EXPLOSION_DEEPSEEK = {1: 6.0, 16: 31.7}
EXPLOSION_GROWTH_1_TO_16 = {"deepseek": 31.7 / 6.0, "qwen": 7.18, "phi": 4.65}

# Routed experts and top-k of the real models the working-set targets are for.
REAL_MOE = {"deepseek": (64, 6), "qwen": (60, 4), "phi": (16, 2)}

# The depth profiler's choice K* = argmin_K TPOT(K).
CHOSEN_K = {"deepseek": 16, "qwen": 8, "phi": 16}

# Robustness: prefetch precision 1.0 -> 0.41 moves TPOT 63.0 -> 84.2 ms; output unchanged.
ROBUSTNESS = {"precision": (1.0, 0.41), "tpot_ms": (63.0, 84.2)}

# Acceptance per draft token: mean over cases, best (DeepSeek); expected accepted run.
ACCEPTANCE = {"mean": 0.9663, "max_deepseek": 0.99, "expected_run": 28.7}
