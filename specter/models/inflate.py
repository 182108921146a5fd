"""A real-size model grown from a trained small one, every layer of it live.

`model.weights=inflated` builds the named real model (its published config.json: every width,
every layer, every expert, every byte and FLOP of it) from a project-made small model of the
same architecture, routing with the small model's trained routers in every one of its MoE
layers. No download, no training: a GPU host builds DeepSeek-V2-Lite's 27 GiB of experts from
the shipped `small_deepseek` in memory in about a minute (placement/loader.py
`load_inflated`). Random weights (`model.weights=random`) have the real sizes too but route
uniformly (17 tokens touch ~52 of 64 experts per layer where the trained model touches ~32) and
accept at random, so they do not measure speculative prefetching; this does.

How the widths grow (DeepSeek-V2; each rule keeps the function exactly, up to float rounding):
- every weight is zero-padded: the small model's values sit in the first rows/columns of each
  block (per attention head: the no-position part, the rotary part, the value part; the expert
  and MLP intermediates; the hidden size), everything else is zero, so the padded activations
  stay exactly zero through every layer;
- RMSNorm over a padded vector divides by a mean over more entries: each norm's weight is scaled
  by sqrt(n/N) and the config's `rms_norm_eps` by n/N (hidden size; the KV latent's norm shares
  the eps and keeps the small model's within a factor of two of 1e-6, which is below fp32's
  effect on these activations);
- attention scores are scaled by qk_head_dim^-1/2, which grows: the query weights are scaled by
  sqrt(qk_big / qk_small);
- rotary pairs: small pair j (interleaved, DeepSeek's complex form) goes to big pair s*j, where
  s = (pairs_big - 1) // (pairs_small - 1), and `rope_theta` becomes theta^(pairs_big /
  (s * pairs_small)) so those pairs turn at the small model's frequencies (the buffer is then
  set to the small model's values bit for bit); the real model's YaRN scaling is dropped (it
  only matters past 4k positions);
- heads beyond the small model's have zero query, key, value and output weights;
- the vocabulary: the embedding and head rows of token v are the small model's rows of
  v mod V_small, so every logit of a padded id equals the real id's, and greedy argmax (the
  first of equal maxima) never picks a padded id; the tokenizer is the small model's. (A logits
  processor that masks a real id, as `generate`'s min_new_tokens masks the EOS, would let its
  copy win; the runner's greedy decoding masks none.)

How the depth grows: the small model's dense layers map one to one onto the real model's
(DeepSeek: layer 0), and its S MoE layers onto S blocks of the real model's MoE layers (26 from
small_deepseek's 3: blocks of 9, 9 and 8). Every layer of block b is a copy of small layer b
(attention, norms, router, shared and routed experts), its expert ids permuted by a seeded
permutation of its own (router rows and experts together, so the ids two layers pick are
unrelated), and every one is live: the k-th of n copies writes (1/n + ATTN_SWING * s_k) of
its attention output and (1/n + MOE_SWING * s_k) of its shared and routed experts' outputs,
where s is a seeded walk of n steps up and down that sums to zero and strays at most two steps
(`swing_signs`). Each scale sums to 1 over the block, so to first order the block adds the
small layer's update once and the residual stream ends each block near the small model's;
between layers it swings about as far as a trained layer moves it, so each layer's router sees
an input of its own. On the benchmark prompts (experiments/inflate_fidelity.py,
docs/measurements/inflate-fidelity-2026-12-06), layer l+1's router applied to layer l's router
input predicts 0.81 of layer l+1's top-6 (0.66-0.88 by layer; small_deepseek's own two
transitions: 0.72 and 0.68), where the zero-output copies this replaces predicted 1.0 in 20 of
25 transitions; a 17-token window touches 31.6 distinct experts per layer (29.4-35.0 by layer;
DeepSeek-V2-Lite: 31.7). A block of one (the small model's own depth) is the small layer
itself, so at that depth the inflated model is the small one.

What that costs: the real-depth model is not the small model. Its greedy tokens part from the
small model's within a few tokens (0.1 of them equal at the same position), while its text is
of the same kind (distinct-4 0.74, the small model's 0.73; held-out wikitext loss 6.78 nats
per token, the small model's 6.81). Its INT4 draft errs in 26 live layers, not 3: at K = 16
on the CPU, at widths whose INT4 groups are the real model's, it accepts 0.87 (GPTQ; RTN 0.86)
where small_deepseek accepts 0.91 (0.90) and the paper reports 0.966 (the measurement's
README).

Honest limits, stated in every record (`model.weights=inflated`, `model.inflated_from`,
`model.inflate_recipe`):
- 26 layers route with 3 trained routers (each permuted), and a block's copies write its
  source layer's update along one direction, back and forth: the stream returns near where it
  was two layers before about half the time, so layer l+2's router predicts from layer l's
  input as well as layer l+1's does (0.81; small_deepseek's falls from 0.70 to 0.53). No
  predictor here looks two layers ahead; one that did would be flattered;
- the swings (ATTN_SWING, MOE_SWING) were set on small_deepseek's measured routing, not
  derived: agreement and distinct experts are measured (experiments/inflate_fidelity.py,
  held by tests/test_inflate.py), not assumed;
- 93% of each expert's weights are zeros: a dense kernel's bytes and FLOPs are the real ones, a
  kernel that skipped zeros would not be (none here does);
- DeepSeek-V2 only. Phi-3.5-MoE cannot be inflated this way: its LayerNorm subtracts the mean
  over every entry, so zero-padded entries come out as -mean (times the padded weight) and
  the centred values change; no scale of the small model's weights undoes that. Qwen1.5-MoE's
  rules would carry over (RMSNorm, rotate-half rotary pairs, a shared-expert gate whose padded
  columns are zero), but small_qwen is no longer shipped (trained on first use, about 30
  minutes on 2 cores), so a GPU host could not build it in the 2 minutes asked.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from specter.config import INFLATE_SOURCES as SOURCES  # (a setting's table: config.py)
from specter.errors import UserError
ARCHS = ("deepseek_v2",)
_SEED = 20261204  # the copies' expert permutations and sign walks
# Names how the depth grows: in the inflated folder's specter_inflated.json, the records
# (`model.inflate_recipe`) and the made experts' checksum (so a draft quantized from another
# recipe's experts is never reused). Before it: zero-output copies (2026-12-04).
RECIPE = "live-swing-2026-12-06"


def check_source(key: str, source: str | None) -> str:
    """The project-made model `key` inflates from (model.inflate_from, or the default)."""
    if key not in SOURCES:
        raise UserError(f"model.weights=inflated builds {', '.join(SOURCES)} from a project-made "
                        f"model of the same architecture; model={key} has no inflation rule "
                        "(use model.weights=random for its sizes without trained routing).")
    return source or SOURCES[key]


def inflated_config(big: dict, small: dict) -> dict:
    """The real model's config.json (`big`, the published one, maybe cut in depth) as the
    inflated model carries it: widths and depth unchanged; rotary theta, norm eps and the
    special token ids follow the small model (`small`, its config.json)."""
    if big.get("model_type") not in ARCHS or small.get("model_type") != big.get("model_type"):
        raise UserError(f"inflation needs two {'/'.join(ARCHS)} configs (got "
                        f"{small.get('model_type')} -> {big.get('model_type')}).")
    cfg = copy.deepcopy(big)
    cfg.pop("auto_map", None)
    cfg.pop("rope_scaling", None)
    for key in ("q_lora_rank",):
        if small.get(key) is not None or big.get(key) is not None:
            raise UserError("inflation handles q_lora_rank null (DeepSeek-V2-Lite) only.")
    _check_widths(big, small)
    theta = _small_theta(small)
    pairs_s, pairs_b = small["qk_rope_head_dim"] // 2, big["qk_rope_head_dim"] // 2
    stride = rope_stride(pairs_s, pairs_b)
    cfg["rope_theta"] = theta ** (pairs_b / (stride * pairs_s))
    cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    cfg["rms_norm_eps"] = small["rms_norm_eps"] * small["hidden_size"] / big["hidden_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[key] = small.get(key)
    cfg["norm_topk_prob"] = small.get("norm_topk_prob", False)
    cfg["routed_scaling_factor"] = small.get("routed_scaling_factor", 1.0)
    cfg["topk_method"] = small.get("topk_method", "greedy")
    cfg["tie_word_embeddings"] = False
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    return cfg


def _small_theta(small: dict) -> float:
    rp = small.get("rope_parameters") or {}
    return float(rp.get("rope_theta", small.get("rope_theta", 10000.0)))


def rope_stride(pairs_s: int, pairs_b: int) -> int:
    return 1 if pairs_s <= 1 else (pairs_b - 1) // (pairs_s - 1)


def _check_widths(big: dict, small: dict) -> None:
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "kv_lora_rank",
                "num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "vocab_size"):
        if big[key] < small[key]:
            raise UserError(f"inflation grows widths only: {key} {small[key]} -> {big[key]}.")
    for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace"):
        if big[key] != small[key]:
            raise UserError(f"inflation keeps {key} ({small[key]} in the small model, {big[key]} "
                            "in the real one).")
    if big["num_attention_heads"] != big["num_key_value_heads"] or \
            small["num_attention_heads"] != small["num_key_value_heads"]:
        raise UserError("inflation needs as many key/value heads as query heads (DeepSeek-V2).")
    moe_s = small["num_hidden_layers"] - small["first_k_dense_replace"]
    moe_b = big["num_hidden_layers"] - big["first_k_dense_replace"]
    if moe_b < moe_s or moe_s < 1:
        raise UserError(f"inflation needs at least the small model's {moe_s} MoE layers "
                        f"(the real config has {moe_b}).")
    if rope_stride(small["qk_rope_head_dim"] // 2, big["qk_rope_head_dim"] // 2) < 1:
        raise UserError("inflation needs at least as many rotary pairs as the small model.")


@dataclass(frozen=True)
class LayerPlan:
    """Where layer `layer` of the real model comes from: small layer `source`, the scales of its
    attention output (`attn`) and of its shared and routed experts' outputs (`moe`), and the
    permutation of its experts' ids (None: identity). Every layer is live: no scale is zero."""

    layer: int
    source: int
    attn: float
    moe: float
    perm: tuple[int, ...] | None


# Each MoE layer of a block of n copies of one small layer writes (1/n + SWING * s_k) of that
# layer's attention and expert outputs, s_k a zero-sum sign sequence: the block adds the small
# layer's update once (to first order) while every layer moves the residual stream as far as a
# trained layer does. The swings are set so that the next layer's router, applied to a layer's
# input, predicts 0.75-0.85 of the next layer's experts and a 17-token window touches ~31.7
# distinct experts per layer (DeepSeek-V2-Lite's published figure), on the project's benchmark
# prompts (experiments/inflate_fidelity.py; docs/measurements/inflate-fidelity-2026-12-06).
ATTN_SWING = 0.7
MOE_SWING = 0.3
MAX_EXCURSION = 2.0  # how far (in steps) a block's sign walk may stray from where it started


def swing_signs(n: int, seed: int) -> list[float]:
    """A seeded sign walk of `n` steps that sums to zero: ceil(n/2) steps up, floor(n/2) down
    (the up steps floor/ceil long, so that an odd block has no still step), in an order whose
    partial sums stay within MAX_EXCURSION; n = 1 gives [0.0]."""
    up, down = (n + 1) // 2, n // 2
    steps = [down / up] * up + [-1.0] * down
    g = torch.Generator().manual_seed(seed)
    while True:
        order = [steps[i] for i in torch.randperm(n, generator=g).tolist()]
        walk, far = 0.0, 0.0
        for step in order:
            walk += step
            far = max(far, abs(walk))
        if far <= MAX_EXCURSION + 1e-9:
            return order


def layer_plan(big: dict, small: dict) -> list[LayerPlan]:
    dense = small["first_k_dense_replace"]
    n_small, n_big = small["num_hidden_layers"], big["num_hidden_layers"]
    moe_s, moe_b = n_small - dense, n_big - dense
    plans = [LayerPlan(i, i, 1.0, 1.0, None) for i in range(dense)]
    E = big["n_routed_experts"]
    sizes = [moe_b // moe_s + (1 if b < moe_b % moe_s else 0) for b in range(moe_s)]
    layer = dense
    for b, size in enumerate(sizes):
        signs = swing_signs(size, _SEED + 1_000 * (b + 1))
        for k in range(size):
            perm = None
            if size > 1:
                g = torch.Generator().manual_seed(_SEED + layer)
                perm = tuple(torch.randperm(E, generator=g).tolist())
            plans.append(LayerPlan(layer, dense + b, 1.0 / size + ATTN_SWING * signs[k],
                                   1.0 / size + MOE_SWING * signs[k], perm))
            layer += 1
    return plans


class Inflation:
    """The real model's tensors, one at a time, from the small model's state dict (transformers'
    module names: fused `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`).
    `tensor(name)` gives a non-expert parameter in fp32; `expert(layer, e, gate_up, down)` writes
    one routed expert into the given views (any dtype)."""

    def __init__(self, state: dict[str, torch.Tensor], small: dict, big: dict):
        self.s, self.small, self.big = state, small, big
        self.plans = {p.layer: p for p in layer_plan(big, small)}
        H, h = big["hidden_size"], small["hidden_size"]
        self.H, self.h = H, h
        self.heads_s = small["num_attention_heads"]
        self.nope = (small["qk_nope_head_dim"], big["qk_nope_head_dim"])
        self.rope = (small["qk_rope_head_dim"], big["qk_rope_head_dim"])
        self.v = (small["v_head_dim"], big["v_head_dim"])
        self.heads_b = big["num_attention_heads"]
        self.stride = rope_stride(self.rope[0] // 2, self.rope[1] // 2)
        qk_s, qk_b = self.nope[0] + self.rope[0], self.nope[1] + self.rope[1]
        self.q_scale = math.sqrt(qk_b / qk_s)

    # -- index maps --------------------------------------------------------------------------
    def rope_rows(self) -> torch.Tensor:
        """Big rotary index of each small rotary index (interleaved pairs: j -> stride*j)."""
        r = torch.arange(self.rope[0])
        return (r // 2) * 2 * self.stride + r % 2

    def inv_freq(self, small_inv_freq: torch.Tensor, big_inv_freq: torch.Tensor) -> torch.Tensor:
        out = big_inv_freq.clone()
        out[torch.arange(self.rope[0] // 2) * self.stride] = small_inv_freq.to(out.dtype)
        return out

    def _norm(self, w: torch.Tensor, N: int) -> torch.Tensor:
        out = torch.zeros(N)
        out[: w.numel()] = w.float() * math.sqrt(w.numel() / N)
        return out

    def _pad(self, w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        out = torch.zeros(rows, cols)
        out[: w.shape[0], : w.shape[1]] = w.float()
        return out

    def _src(self, name: str) -> tuple[str, LayerPlan | None]:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            plan = self.plans[int(parts[2])]
            parts[2] = str(plan.source)
            return ".".join(parts), plan
        return name, None

    # -- non-expert tensors ------------------------------------------------------------------
    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        src, plan = self._src(name)
        w = self.s[src].float()
        leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        H = self.H
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            V = shape[0]
            idx = torch.arange(V) % w.shape[0]
            return self._pad(w, w.shape[0], H)[idx]
        if w.dim() == 1:  # norms
            return self._norm(w, shape[0])
        if leaf == "q_proj":
            out = torch.zeros(self.heads_b, self.nope[1] + self.rope[1], H)
            ws = w.view(self.heads_s, self.nope[0] + self.rope[0], self.h) * self.q_scale
            out[: self.heads_s, : self.nope[0], : self.h] = ws[:, : self.nope[0]]
            out[: self.heads_s, self.nope[1] + self.rope_rows(), : self.h] = ws[:, self.nope[0]:]
            return out.reshape(shape)
        if leaf == "kv_a_proj_with_mqa":
            lora_s, lora_b = self.small["kv_lora_rank"], self.big["kv_lora_rank"]
            out = torch.zeros(shape)
            out[:lora_s, : self.h] = w[:lora_s]
            out[lora_b + self.rope_rows(), : self.h] = w[lora_s:]
            return out
        if leaf == "kv_b_proj":
            lora_s = self.small["kv_lora_rank"]
            out = torch.zeros(self.heads_b, self.nope[1] + self.v[1], shape[1])
            ws = w.view(self.heads_s, self.nope[0] + self.v[0], lora_s)
            out[: self.heads_s, : self.nope[0], :lora_s] = ws[:, : self.nope[0]]
            out[: self.heads_s, self.nope[1]: self.nope[1] + self.v[0], :lora_s] = ws[:, self.nope[0]:]
            return out.reshape(shape)
        if leaf == "o_proj":
            out = torch.zeros(H, self.heads_b, self.v[1])
            out[: self.h, : self.heads_s, : self.v[0]] = \
                w.view(self.h, self.heads_s, self.v[0]) * plan.attn
            return out.reshape(shape)
        if leaf == "gate" and ".mlp.gate." in name:  # the router [E, H]
            out = self._pad(w, w.shape[0], H)
            return out[list(plan.perm)] if plan.perm is not None else out
        if leaf in ("gate_proj", "up_proj"):  # dense MLP and shared experts [I, H]
            return self._pad(w, shape[0], shape[1])
        if leaf == "down_proj":  # [H, I]: a dense MLP's (scale 1) or the shared experts'
            return self._pad(w * plan.moe, shape[0], shape[1])
        raise KeyError(f"inflation has no rule for {name}")

    # -- routed experts ----------------------------------------------------------------------
    def expert(self, layer: int, e: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Expert `e` of (real) layer `layer` into `gate_up` [2I, H] and `down` [H, I]."""
        plan = self.plans[layer]
        src_e = plan.perm[e] if plan.perm is not None else e
        prefix = f"model.layers.{plan.source}.mlp.experts."
        gu = self.s[prefix + "gate_up_proj"][src_e]
        i_s, I = gu.shape[0] // 2, gate_up.shape[0] // 2
        gate_up.zero_()
        down.zero_()
        gate_up[:i_s, : self.h] = gu[:i_s]
        gate_up[I: I + i_s, : self.h] = gu[i_s:]
        down[: self.h, :i_s] = self.s[prefix + "down_proj"][src_e].float() * plan.moe

    def moe_layers(self) -> list[int]:
        dense = self.big["first_k_dense_replace"]
        return list(range(dense, self.big["num_hidden_layers"]))


def inflate_module(small_model: torch.nn.Module, big: dict, dtype=torch.float32) -> torch.nn.Module:
    """The inflated model as a plain transformers module on the CPU, every tensor real (for
    tests and fidelity checks at reduced sizes; the runner builds it through the placement
    plan instead: placement/loader.py `load_inflated`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = small_model.config.to_dict()
    cfg = inflated_config(big, small)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"},
                                  model_type=cfg["model_type"])
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    inf = Inflation({k: v.detach() for k, v in small_model.state_dict().items()}, small, cfg)
    from specter.models.introspect import experts_modules

    expert_ids = {}
    for i, (_, m) in enumerate(experts_modules(model)):
        expert_ids[id(m.gate_up_proj)] = expert_ids[id(m.down_proj)] = inf.moe_layers()[i]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in expert_ids:
                continue
            p.copy_(inf.tensor(name, tuple(p.shape)).to(p.dtype))
        for i, (_, m) in enumerate(experts_modules(model)):
            layer = inf.moe_layers()[i]
            for e in range(m.gate_up_proj.shape[0]):
                inf.expert(layer, e, m.gate_up_proj[e], m.down_proj[e])
        set_rotary(model, small_model, inf)
    if getattr(small_model, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(small_model.generation_config)
    return model


def set_rotary(model: torch.nn.Module, small_model_or_buffers, inf: Inflation) -> None:
    """The rotary frequencies of the kept pairs set to the small model's, bit for bit."""
    small = (dict(small_model_or_buffers.named_buffers())
             if isinstance(small_model_or_buffers, torch.nn.Module) else small_model_or_buffers)
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq") and name in small:
            buf.copy_(inf.inv_freq(small[name], buf))
