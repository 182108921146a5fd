"""`system=quasi_hidden`: "Speculating Experts" (arXiv 2603.19289): autoregressive greedy
decoding over offloaded experts (MO-SM's LRU cache, demand misses loaded on demand) plus an
intra-token prefetch of the next MoE layer's experts from a quasi-hidden state

    q_l = LN_{l+1}(r_l + d_l),   d_l = sum_k w_k * d_{l,e_k} + s_l

r_l is the residual stream of MoE layer l's decoder layer after attention (the input of its
`post_attention_layernorm`), e_k / w_k the experts and weights layer l's router chose for the
token, d_{l,e} expert e's default vector (its mean unweighted output over the calibration
tokens routed to it, measured offline on the full-precision model and saved once), and
LN_{l+1} the norm in front of MoE layer l+1's router. That router applied to q_l guesses
layer l+1's top-k, which are copied behind layer l's demand copies. A wrong guess only costs
a transfer; misses stay misses, so the output is the target's.

Our reading, where the seed is silent:
- s_l, the mean output of the layer's shared branch (DeepSeek `shared_experts`, Qwen2-MoE's
  sigmoid-gated `shared_expert`; zero without one), is added: the seed defines d_l over the
  routed experts only, but the block output r_l + d_l is what the next layer sees.
- An expert never routed to during calibration gets the mean of all routed outputs of its
  layer (over every routed (token, expert) pair).
- Layer l+1's attention is skipped (that is the speculation); when MoE layers are not
  adjacent, so are the dense layers between them.
- The router on q_l is charged on the virtual clock like MO-SM's; the norm and the k x H
  default-vector combination are negligible and not charged.
- The cache key is the experts' checksum (as the INT4 draft's) and the calibration spec;
  the non-expert weights are assumed to come with the experts of one checkpoint.

Owns: measuring, saving and reusing the default vectors; the quasi-hidden prefetcher and its
guess-quality statistics. Does not own: the cache, the link or the decode loop (baselines/lru.py).

T = tokens in this forward, k = top-k, H = hidden, E = routed experts, L = MoE layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from baselines.mo_sm import router_of
from specter.decoding.engines import GreedyEngine, build_greedy
from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.offload.prefetch import LayerPrefetcher
from specter.offload.store import expert_layout, expert_weights
from specter.quant.calibrate import QuantSpec, calibration_windows, source_checksum

ENGINE = GreedyEngine

UNROUTED = "mean of the layer's routed outputs"


@dataclass
class DefaultVectors:
    """Per MoE layer: each routed expert's default vector and the shared branch's mean."""

    default: torch.Tensor  # [L, E, H] mean unweighted output of each expert on its tokens
    shared: torch.Tensor  # [L, H] mean shared-branch output over all tokens (zeros if none)
    counts: torch.Tensor  # [L, E] calibration tokens routed to each expert


@torch.no_grad()
def measure_default_vectors(model: nn.Module, windows: list[torch.Tensor],
                            device: torch.device) -> DefaultVectors:
    """One pass of `windows` through the full-precision `model` (weights untouched): each
    routed expert's output on the tokens routed to it, and the block output minus the routed
    output (the shared branch)."""
    if not windows:
        raise UserError("quasi_hidden measures default vectors on calibration text, but none "
                        "was found; set quant.calib_tokens to at least 1.")
    mods = experts_modules(model)
    layout = expert_layout(model)
    n_exp, hid = layout.num_experts, layout.hidden
    sums = torch.zeros(len(mods), n_exp, hid, dtype=torch.float64, device=device)
    counts = torch.zeros(len(mods), n_exp, dtype=torch.int64, device=device)
    shared_sum = torch.zeros(len(mods), hid, dtype=torch.float64, device=device)
    tokens = [0] * len(mods)
    routed: list[torch.Tensor | None] = [None] * len(mods)

    def on_experts(l: int, m: nn.Module, args, out: torch.Tensor) -> None:
        hidden, top_k_index, _ = args  # [T, H], [T, k]
        for e in torch.unique(top_k_index).tolist():  # host sync: calibration only
            token_idx = (top_k_index == e).any(dim=-1).nonzero().squeeze(-1)
            gate_up, down = expert_weights(model, l, e, hidden.device)
            h = m._apply_gate(nn.functional.linear(hidden[token_idx], gate_up))  # [n, I]
            sums[l, e] += nn.functional.linear(h, down).double().sum(0)
            counts[l, e] += token_idx.numel()
        routed[l] = out

    def on_block(l: int, m: nn.Module, args, out: torch.Tensor) -> None:
        shared = out.reshape(-1, hid) - routed[l]  # [T, H]: exactly zero without a shared branch
        shared_sum[l] += shared.double().sum(0)
        tokens[l] += shared.shape[0]

    layers = model.model.layers
    handles = []
    for l, (i, m) in enumerate(mods):
        handles.append(m.register_forward_hook(lambda m, a, o, l=l: on_experts(l, m, a, o)))
        block = layers[i].mlp
        handles.append(block.register_forward_hook(lambda m, a, o, l=l: on_block(l, m, a, o)))
    try:
        for w in windows:
            model(input_ids=w.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    layer_mean = sums.sum(1) / counts.sum(1, keepdim=True).clamp(min=1)  # [L, H]
    default = torch.where(counts[..., None] > 0, sums / counts[..., None].clamp(min=1),
                          layer_mean[:, None, :])  # [L, E, H]
    shared = shared_sum / torch.tensor(tokens, device=device, dtype=torch.float64)[:, None]
    return DefaultVectors(default.float().cpu(), shared.float().cpu(), counts.cpu())


def save_default_vectors(dv: DefaultVectors, out: Path, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    save_file({"default": dv.default.contiguous(), "shared": dv.shared.contiguous(),
               "counts": dv.counts.contiguous()}, str(tmp), metadata=meta)
    os.replace(tmp, out)


def load_default_vectors(path: Path) -> DefaultVectors:
    from safetensors.torch import load_file

    t = load_file(str(path))
    return DefaultVectors(t["default"], t["shared"], t["counts"])


def ensure_default_vectors(model: nn.Module, tokenizer, spec: QuantSpec, cache_dir: Path,
                           device: torch.device, data_dir: Path | None = None
                           ) -> tuple[DefaultVectors, Path, bool]:
    """The default vectors of `model` under the calibration of `spec`: loaded when measured
    before (same experts checksum and calibration), else measured and saved. Returns
    (vectors, path, reused)."""
    from filelock import FileLock

    key = f"{source_checksum(model)}-t{spec.calib_tokens}s{spec.seq_len}k{spec.calib_skip}"
    out = cache_dir / "default_vectors" / f"{key}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return load_default_vectors(out), out, True
        windows = calibration_windows(tokenizer, spec, data_dir)
        dv = measure_default_vectors(model, windows, device)
        save_default_vectors(dv, out, {"format": "specter-default-vectors", "key": key,
                                       "calib_windows": str(len(windows)), "unrouted": UNROUTED})
    return dv, out, False


class QuasiHiddenPrefetch(LayerPrefetcher):
    """After layer l's demand copies: router(l+1) on q_l = LN_{l+1}(r_l + d_l); loads its
    top-k for layer l+1 (those not resident) and scores the guess when layer l+1 routes."""

    def __init__(self, model: nn.Module, vectors: DefaultVectors, path: Path):
        layers = model.model.layers
        decoder = [i for i, _ in experts_modules(model)]
        for i in decoder:
            if not isinstance(getattr(layers[i], "post_attention_layernorm", None), nn.Module):
                raise UserError(f"system=quasi_hidden needs a post_attention_layernorm in every "
                                f"MoE decoder layer; layer {i} of {type(model).__name__} has "
                                "none, so use system=mo_sm for this model.")
        self.norms = [layers[i].post_attention_layernorm for i in decoder]
        self.routers = [router_of(layers[i].mlp) for i in decoder]
        p = next(model.parameters())
        self.default = vectors.default.to(p.device, p.dtype)  # [L, E, H]
        self.shared = vectors.shared.to(p.device, p.dtype)  # [L, H]
        self.path = path
        self.residual: list[torch.Tensor | None] = [None] * len(decoder)  # r_l, [1, T, H]
        for l, norm in enumerate(self.norms):
            norm.register_forward_pre_hook(lambda m, args, l=l: self._capture(l, args[0]))
        self.pending: torch.Tensor | None = None  # the guess for the next MoE layer, [T, k]
        self.reset()

    def _capture(self, l: int, residual: torch.Tensor) -> None:
        self.residual[l] = residual

    def reset(self) -> None:
        self.hits = self.guessed = self.chosen = 0

    def quasi_hidden(self, l: int, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
        """q_l [T, H] from layer l's residual and routing."""
        r = self.residual[l]
        r = r.reshape(-1, r.shape[-1])  # [T, H]
        w = top_k_weights.to(self.default.dtype)[..., None]  # [T, k, 1]
        d = (w * self.default[l][top_k_index]).sum(1) + self.shared[l]  # [T, H]
        return self.norms[l + 1].forward(r + d)  # .forward: not a residual, skip the capture hook

    def after_demand(self, runtime, moe_layer: int, hidden: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        guess, self.pending = self.pending, None
        if guess is not None and runtime.stats.counting:
            self.hits += overlap(guess, top_k_index)
            self.guessed += guess.numel()
            self.chosen += top_k_index.numel()
        nxt = moe_layer + 1
        if nxt >= len(self.routers):
            return
        q = self.quasi_hidden(moe_layer, top_k_index, top_k_weights)
        self.pending = self.routers[nxt](q)[2]  # (logits, weights, top-k index): [T, k]
        runtime.clock.router(q.shape[0])
        runtime.prefetch(nxt, sorted(set(self.pending.flatten().tolist())))  # one read: a host decision

    def as_record(self) -> dict:
        nan = float("nan")
        hits = int(self.hits)  # the request's one read of the statistic
        return {"qh_precision": hits / self.guessed if self.guessed else nan,
                "qh_recall": hits / self.chosen if self.chosen else nan,
                "default_vectors": str(self.path)}


def overlap(guess: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Guessed experts [T, k'] that the router chose for the same token [T, k], summed (a
    device scalar: the statistic is read once, in `as_record`, not per layer)."""
    return (guess[:, :, None] == chosen[:, None, :]).any(-1).sum()


def default_vectors_for(job) -> tuple[DefaultVectors, Path]:
    """The default vectors of `job.loaded.model` (before its experts are offloaded), calibrated
    on `quant.calib_tokens` tokens of the workloads' text."""
    cache_dir, data_dir = job.files.cache_dir, job.files.data_dir
    spec = QuantSpec(calib_tokens=job.draft.quant.calib_tokens)
    dv, path, _ = ensure_default_vectors(job.loaded.model, job.loaded.tokenizer, spec, cache_dir,
                                         job.device, data_dir)
    return dv, path


def build_with(job, prefetch: QuasiHiddenPrefetch) -> GreedyEngine:
    """The engine around a given prefetcher (tests pass deliberately broken ones)."""
    return build_greedy(job, "quasi_hidden", prefetch)


def build(job) -> GreedyEngine:
    dv, path = default_vectors_for(job)  # 1. measured on the full model, before offloading
    return build_with(job, QuasiHiddenPrefetch(job.loaded.model, dv, path))
