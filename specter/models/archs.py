"""The project-made architectures: the table of what each one is.

Owns: each architecture's Hugging Face config at a given shape (the same routed-expert count,
top-k and shared-expert structure as the real model it stands for; fewer layers, smaller
hidden size), the sizes (`tiny_*` for tests, `small_*` for benchmarks) with their training
budgets, which real model each stands for, and each benchmark model's router balancing.
Does not own: building, training and caching them (zoo.py), loading (loading.py).
A new architecture is one config function here and one entry in ARCHS (and a conf/model yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specter.errors import UserError

TOKENIZER_VOCAB = 4096
TOKENIZER_CORPUS_BYTES = 2_000_000


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    expert_inter: int  # routed expert intermediate size
    dense_inter: int  # dense FFN intermediate size (DeepSeek's first layer)


@dataclass(frozen=True)
class Training:
    steps: int
    batch: int
    seq_len: int
    lr: float
    corpus_bytes: int


TINY = (ModelShape(hidden=64, layers=3, heads=4, expert_inter=32, dense_inter=128),
        Training(steps=300, batch=8, seq_len=64, lr=5e-3, corpus_bytes=400_000))
SMALL = (ModelShape(hidden=192, layers=4, heads=4, expert_inter=96, dense_inter=384),
         Training(steps=1000, batch=16, seq_len=128, lr=3e-3, corpus_bytes=TOKENIZER_CORPUS_BYTES))


def _deepseek(s: ModelShape, vocab: int, special: dict):
    from transformers import DeepseekV2Config

    # DeepSeek-V2-Lite: 64 routed / top-6 / 2 shared, first layer dense, MLA without q-LoRA.
    head = s.hidden // s.heads
    return DeepseekV2Config(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.dense_inter,
        moe_intermediate_size=s.expert_inter, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.heads,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        kv_lora_rank=s.hidden // 2, q_lora_rank=None, qk_nope_head_dim=head,
        qk_rope_head_dim=head // 2, v_head_dim=head, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=1024, **special)


def _dense(s: ModelShape, vocab: int, special: dict):
    """The dense twin of the DeepSeek-shaped model (for the working-set comparison): the same
    layers, attention, shared experts and 64 expert-sized blocks, but every token uses all 64
    blocks with the weight 1/64 (the router is frozen at zero: softmax of equal logits). The
    sum over blocks is one dense SwiGLU FFN of 64 x moe_intermediate columns, so the model has
    the MoE's total size with every parameter active, and it offloads in the same units."""
    cfg = _deepseek(s, vocab, special)
    cfg.num_experts_per_tok = cfg.n_routed_experts
    return cfg


DENSE_ARCHS = ("dense",)  # routers frozen at zero during training (see _dense)


def _qwen(s: ModelShape, vocab: int, special: dict):
    from transformers import Qwen2MoeConfig

    # Qwen1.5-MoE-A2.7B: 60 routed / top-4 / 1 shared expert of 4x size behind a sigmoid gate.
    return Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.dense_inter,
        moe_intermediate_size=s.expert_inter, shared_expert_intermediate_size=4 * s.expert_inter,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
        max_position_embeddings=1024, router_aux_loss_coef=0.01, **special)


def _phi(s: ModelShape, vocab: int, special: dict):
    from transformers import PhimoeConfig

    # Phi-3.5-MoE: 16 routed / top-2, no shared expert. Jitter off so routing is deterministic.
    return PhimoeConfig(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.expert_inter,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
        num_local_experts=16, num_experts_per_tok=2, router_jitter_noise=0.0,
        input_jitter_noise=0.0, max_position_embeddings=1024, sliding_window=None,
        router_aux_loss_coef=0.01, **special)


def _mixtral(s: ModelShape, vocab: int, special: dict):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.expert_inter,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads // 2,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
        router_aux_loss_coef=0.01, **special)


def _qwen3(s: ModelShape, vocab: int, special: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.dense_inter,
        moe_intermediate_size=s.expert_inter, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.heads // 2, head_dim=s.hidden // s.heads,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=1024, router_aux_loss_coef=0.01, **special)


def _olmoe(s: ModelShape, vocab: int, special: dict):
    from transformers import OlmoeConfig

    return OlmoeConfig(
        vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.expert_inter,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
        num_experts=64, num_experts_per_tok=8, max_position_embeddings=1024,
        router_aux_loss_coef=0.01, **special)


ARCHS: dict[str, Callable] = {
    "deepseek": _deepseek, "qwen": _qwen, "phi": _phi,
    "mixtral": _mixtral, "qwen3": _qwen3, "olmoe": _olmoe, "dense": _dense,
}
SIZES = {"tiny": TINY, "small": SMALL}
# Which real model each project-made architecture stands for (None: kept for genericity only).
STANDS_FOR = {"deepseek": "deepseek", "qwen": "qwen", "phi": "phi",
              "mixtral": None, "qwen3": None, "olmoe": None,
              "dense": "deepseek"}  # charged as DeepSeek-V2-Lite's shapes, all experts active
PROJECT_MODELS = tuple(f"{size}_{arch}" for size in SIZES for arch in ARCHS)


def parse_name(name: str) -> tuple[str, str]:
    size, _, arch = name.partition("_")
    if size not in SIZES or arch not in ARCHS:
        raise UserError(f"unknown project-made model '{name}'; choose one of: "
                        f"{', '.join(PROJECT_MODELS)}.")
    return size, arch


# Per-layer router load balancing for the benchmark-size models (docs/routing.md): the coefficient of a
# Switch-style balance loss, E * sum_e f_e * P_e, averaged over MoE layers, added to the LM loss
# in training (f_e: share of the layer's top-k choices that went to expert e; P_e: the layer's
# mean router probability of e). It replaces HF's own auxiliary loss, which DeepSeek-V2 lacks and
# which Qwen2-MoE/Phi pool over all layers at once (so one layer may collapse while another
# spreads). Larger coefficients spread a window's tokens over more experts: the working-set
# curve rises towards uniform routing. Each value is the one, from a measured sweep
# (docs/routing.md), whose curve on the benchmark prompts lies nearest its real model's;
# small_phi keeps HF's pooled loss (0.01), already within the target (the per-layer one at
# 0.01 overshoots by 25%); small_mixtral 0.1 matches the Mixtral paper's repeated assignments of
# consecutive tokens (docs/routing.md, "Mixtral-8x7B and Qwen3-30B-A3B"); the models without a
# published target keep theirs.
ROUTER_BALANCE = {"small_deepseek": 0.01, "small_qwen": 0.3, "small_mixtral": 0.1}
