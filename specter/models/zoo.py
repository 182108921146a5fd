"""Project-made MoE models: scaled copies of the real architectures, trained briefly on local text.

Owns: the shape of every project-made model (same routed-expert count, top-k and shared-expert
structure as the real model it stands for; fewer layers, smaller hidden size), the short
training run that makes routing depend on the data, and the on-disk cache of the results as
ordinary Hugging Face checkpoints (safetensors + tokenizer), so they load through exactly the
code path real checkpoints use (loading.py).
Does not own: loading, devices, dtypes (loading.py); anything about offloading.

Sizes: `tiny_*` are for tests (built in seconds), `small_*` for benchmarks (minutes, once).
Everything is deterministic for a seed on a given machine and Python release (the stdlib
text is part of the training data; its digest is stored with the checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from specter.errors import UserError
from specter.models import corpus

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
EVERY_EXPERT_IMPL = "specter_every_expert"  # the dense twin's experts forward while training


def _every_expert_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token as two large matmuls, weighted by the routing weights
    scattered to [T, E] (zero where a token did not route). Equal to HF's per-expert loop up to
    rounding; for the dense twin, where every token routes everywhere, it trains ~10x faster."""
    t, h = hidden_states.shape
    e, two_i, _ = self.gate_up_proj.shape
    w = hidden_states.new_zeros(t, e).scatter(1, top_k_index, top_k_weights.to(hidden_states.dtype))
    up = (hidden_states @ self.gate_up_proj.reshape(e * two_i, h).T).reshape(t * e, two_i)
    act = self._apply_gate(up).reshape(t, e, -1) * w[..., None]  # [T, E, I]
    return torch.einsum("tei,ehi->th", act, self.down_proj)


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


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECTER_CACHE", Path.home() / ".cache" / "specter"))


# Per-layer router load balancing for the benchmark-size models (docs/routing.md): the coefficient of a
# Switch-style balance loss, E * sum_e f_e * P_e, averaged over MoE layers, added to the LM loss
# in training (f_e: share of the layer's top-k choices that went to expert e; P_e: the layer's
# mean router probability of e). It replaces HF's own auxiliary loss, which DeepSeek-V2 lacks and
# which Qwen2-MoE/Phi pool over all layers at once (so one layer may collapse while another
# spreads). Larger coefficients spread a window's tokens over more experts: the working-set
# curve rises towards uniform routing. Each value is the one, from a measured sweep
# (docs/routing.md), whose curve on the benchmark prompts lies nearest its real model's;
# small_phi keeps HF's pooled loss (0.01), already within the target (the per-layer one at
# 0.01 overshoots by 25%), and the models without a published target keep theirs.
ROUTER_BALANCE = {"small_deepseek": 0.01, "small_qwen": 0.3}


def _recipe(name: str, seed: int, router_balance: float | None = None) -> dict:
    """The build recipe (hashed into the cache key). `router_balance` overrides the model's
    ROUTER_BALANCE coefficient (the sweep in experiments.routing_report uses it)."""
    size, arch = parse_name(name)
    balance = ROUTER_BALANCE.get(name) if router_balance is None else router_balance
    shape, training = SIZES[size]
    if arch in DENSE_ARCHS and size == "small":
        # Every block active makes a training step ~10x a MoE step on the CPU: fewer steps
        # (the same batches otherwise); its loss is in specter_build.json beside the MoE's.
        training = replace(training, steps=300)
    return {"name": name, "arch": arch, "size": size, "seed": seed, "shape": asdict(shape),
            "training": asdict(training), "tokenizer_vocab": TOKENIZER_VOCAB,
            "recipe_version": 3,
            **({"router_balance": balance} if balance is not None else {}),
            **({"train_experts_forward": EVERY_EXPERT_IMPL} if arch in DENSE_ARCHS else {})}


def checkpoint_dir(name: str, seed: int = 0, cache_dir: Path | None = None,
                   router_balance: float | None = None) -> Path:
    """Where the checkpoint for (name, seed) lives; the folder name hashes the recipe."""
    recipe = _recipe(name, seed, router_balance)
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    return (cache_dir or default_cache_dir()) / "models" / f"{name}-s{seed}-{digest}"


def ensure_project_model(name: str, seed: int = 0, cache_dir: Path | None = None,
                         progress: bool = True, router_balance: float | None = None) -> Path:
    """Return the checkpoint folder of a project-made model, building it once if needed."""
    from filelock import FileLock

    out = checkpoint_dir(name, seed, cache_dir, router_balance)
    if (out / "specter_build.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "specter_build.json").exists():  # another process built it meanwhile
            return out
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _build(_recipe(name, seed, router_balance), tmp, cache_dir or default_cache_dir(), progress)
        os.replace(tmp, out)
    return out


def ensure_tokenizer(cache_dir: Path):
    """The shared project tokenizer (trained once, cached)."""
    from filelock import FileLock
    from transformers import AutoTokenizer

    out = cache_dir / "tokenizer" / f"bpe{TOKENIZER_VOCAB}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "tokenizer.json").exists():
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            docs = corpus.corpus_documents(TOKENIZER_CORPUS_BYTES)
            corpus.train_tokenizer(docs, TOKENIZER_VOCAB, tmp)
            (tmp / "corpus_digest.txt").write_text(corpus.corpus_digest(docs))
            os.replace(tmp, out)
    return AutoTokenizer.from_pretrained(str(out))


def _build(recipe: dict, out: Path, cache_dir: Path, progress: bool) -> None:
    """Steps: 1 tokenizer, 2 config + init, 3 train, 4 routing stats, 5 save."""
    from specter.models import routing_stats

    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.time()
    shape, training = ModelShape(**recipe["shape"]), Training(**recipe["training"])
    # 1. Tokenizer and token stream.
    tok = ensure_tokenizer(cache_dir)
    docs = corpus.corpus_documents(training.corpus_bytes)
    stream = torch.tensor(corpus.encode_corpus(tok, docs), dtype=torch.long)
    # 2. Config and deterministic init.
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    config = ARCHS[recipe["arch"]](shape, len(tok), special)
    torch.manual_seed(recipe["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense = recipe["arch"] in DENSE_ARCHS
    if dense:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        _freeze_routers(model)
        if EVERY_EXPERT_IMPL not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(EVERY_EXPERT_IMPL, _every_expert_forward)
        saved_impl = getattr(model.config, "_experts_implementation", None)
        model.config._experts_implementation = EVERY_EXPERT_IMPL
    # 3. Train on random windows of the stream (deterministic kernels: some MoE backward
    #    ops otherwise accumulate in a thread-dependent order).
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        losses = _train(model, stream, training, recipe["seed"], progress, recipe["name"],
                        recipe.get("router_balance"))
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if dense:  # saved and evaluated with HF's own experts forward
            model.config._experts_implementation = saved_impl
    # 4. How specialised the routing became (held-out windows).
    load_entropy = _routing_entropy(model, stream, training, recipe["seed"])
    #    ... and how it routes on the benchmark prompts (the working-set curve and the rest,
    #    for the routing report and for every result row; routing_stats.py).
    t_route = time.time()
    routing = routing_stats.measure(model, routing_stats.benchmark_prompts(tok))
    routing["seconds"] = round(time.time() - t_route, 1)
    # 5. Save as an ordinary HF checkpoint.
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    meta = dict(recipe, corpus_digest=corpus.corpus_digest(docs), corpus_tokens=len(stream),
                parameters=sum(p.numel() for p in model.parameters()),
                loss_first=losses[0], loss_last=sum(losses[-10:]) / len(losses[-10:]),
                routing_load_entropy=load_entropy, routing_benchmark=routing,
                build_seconds=round(time.time() - t0, 1),
                torch=torch.__version__)
    (out / "specter_build.json").write_text(json.dumps(meta, indent=2))


def _freeze_routers(model) -> None:
    """Zero every MoE router and take it out of training: equal logits, equal weights."""
    from specter.models.introspect import experts_modules

    for i, _ in experts_modules(model):
        gate = model.model.layers[i].mlp.gate  # DeepSeek layout (the only dense twin)
        gate.weight.data.zero_()
        gate.weight.requires_grad_(False)


class _BalanceLoss:
    """Collects the per-layer Switch balance term of every router during a forward."""

    def __init__(self, model):
        from specter.models.introspect import routers

        self.terms: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._hook) for r in routers(model)]

    def _hook(self, _mod, _args, out):
        logits, idx = out[0], out[-1]
        n_exp = logits.shape[-1]
        probs = logits.float().softmax(-1).reshape(-1, n_exp)  # [T, E]
        share = torch.bincount(idx.reshape(-1), minlength=n_exp).float() / idx.numel()
        self.terms.append(n_exp * (share * probs.mean(0)).sum())

    def take(self) -> torch.Tensor:
        loss = torch.stack(self.terms).mean()
        self.terms.clear()
        return loss

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _train(model, stream: torch.Tensor, tr: Training, seed: int, progress: bool,
           name: str, router_balance: float | None = None) -> list[float]:
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, weight_decay=0.01)
    warmup = max(1, tr.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / tr.steps)))
    # HF's own auxiliary loss unless the recipe asks for the per-layer one.
    uses_aux = (router_balance is None
                and getattr(model.config, "router_aux_loss_coef", None) is not None)
    balance = _BalanceLoss(model) if router_balance is not None else None
    model.train()
    losses: list[float] = []
    bar = tqdm(range(tr.steps), desc=f"training {name}", disable=not progress, leave=False)
    for _ in bar:
        starts = torch.randint(0, len(stream) - tr.seq_len - 1, (tr.batch,), generator=gen)
        x = torch.stack([stream[s:s + tr.seq_len] for s in starts.tolist()])  # [B, T]
        kwargs = {"output_router_logits": True} if uses_aux else {}
        lm_loss = model(input_ids=x, labels=x, use_cache=False, **kwargs).loss
        loss = lm_loss if balance is None else lm_loss + router_balance * balance.take()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(lm_loss.item())  # host sync: once per training step; LM loss only
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if balance is not None:
        balance.remove()
    model.eval()
    return losses


@torch.no_grad()
def _routing_entropy(model, stream: torch.Tensor, tr: Training, seed: int) -> float:
    """Mean over MoE layers of (entropy of expert load) / log(E) on held-out training windows:
    1.0 is uniform routing."""
    from specter.models.introspect import experts_modules, router_topk
    from specter.models.routing_stats import load_entropy

    gen = torch.Generator().manual_seed(seed + 2)
    starts = torch.randint(0, len(stream) - tr.seq_len - 1, (4,), generator=gen)
    x = torch.stack([stream[s:s + tr.seq_len] for s in starts.tolist()])
    n_exp = experts_modules(model)[0][1].gate_up_proj.shape[0]
    per_layer = [load_entropy(t, n_exp) for t in router_topk(model, x)]
    return round(sum(per_layer) / len(per_layer), 4)
