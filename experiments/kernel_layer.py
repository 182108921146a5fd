"""The kernel microbenchmark's data: one MoE layer at a real model's expert shape.

Owns: the expert shapes (from specter.models.real_configs, plus a tiny synthetic one), seeded
random routing and random INT4 experts in QuantizedMatrix's layout (bf16-exact values, so
every dtype sees the same numbers), the target's full-precision expert paths (the offload
runtime's own `expert_output` / `sum_in_expert_order`), the dequantize-then-matmul reference
over a bounded weight pool, and the agreement check (`rel_err`, `tolerance`).
Used by experiments/kernel_bench.py (the cases and CLI) with experiments/kernel_timing.py.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from specter.errors import UserError
from specter.grouping import group_by_expert
from specter.offload.mlp import expert_output, sum_in_expert_order
from specter.quant.formats import QuantizedMatrix, effective_group

GROUP = 128  # conf/quant: the draft's INT4 group size


@dataclass(frozen=True)
class ExpertShape:
    name: str
    hidden: int
    inter: int  # one routed expert's intermediate width
    n_experts: int  # routed experts per MoE layer
    top_k: int
    source: str  # the real model's hub id, or "synthetic"


def _real_shape(name: str) -> ExpertShape:
    from specter.models.real_configs import REAL_CONFIGS

    c = REAL_CONFIGS[name]
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    return ExpertShape(name, c["hidden_size"], c.get("moe_intermediate_size") or c["intermediate_size"],
                 experts, c["num_experts_per_tok"], c["_name_or_path"])


REAL_SHAPES = ("deepseek", "qwen", "phi")


# A synthetic layer for tests (seconds, not minutes); its modelled rows charge its own size.
TINY = ExpertShape("tiny", hidden=64, inter=32, n_experts=8, top_k=2, source="synthetic")


def shape_of(name: str) -> ExpertShape:
    if name == TINY.name:
        return TINY
    if name not in REAL_SHAPES:
        raise UserError(f"unknown shape '{name}'; choose from: "
                        f"{', '.join(REAL_SHAPES + ('tiny',))}.")
    return _real_shape(name)


# ------------------------------------------------------------------------------- the layer
def _act(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate_up output (gate first), as all three real models use."""
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(":".join(map(str, key)).encode()))


def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back: values every dtype here holds exactly (bf16, fp16, fp32), so all
    backends see the same numbers whatever their dtype."""
    return t.to(torch.bfloat16).float()


@dataclass
class Routing:
    hidden: torch.Tensor  # [T, H] fp32 (bf16-exact)
    index: torch.Tensor  # [T, k] real expert ids
    weights: torch.Tensor  # [T, k] fp32 (bf16-exact)

    def counts(self) -> list[int]:
        """Tokens routed to each distinct expert, in expert-id order."""
        return torch.unique(self.index, return_counts=True)[1].tolist()


def draw_routing(shape: ExpertShape, tokens: int, seed: int) -> Routing:
    g = _generator(seed, shape.name, tokens)
    hidden = _bf16_exact(torch.randn(tokens, shape.hidden, generator=g))
    index = torch.stack([torch.randperm(shape.n_experts, generator=g)[:shape.top_k]
                         for _ in range(tokens)])
    weights = _bf16_exact(torch.softmax(torch.randn(tokens, shape.top_k, generator=g), dim=-1))
    return Routing(hidden, index, weights)


def random_int4(out: int, inp: int, g: torch.Generator) -> QuantizedMatrix:
    """A random INT4 matrix in the project's layout: uniform codes, positive group scales sized
    so that W x keeps the scale of x (bf16-exact, fp32)."""
    group = effective_group(inp, GROUP)
    codes = torch.randint(0, 256, (out, inp // 2), generator=g, dtype=torch.uint8)
    scales = (0.75 + 0.5 * torch.rand(out, inp // group, generator=g)) / (4.6 * math.sqrt(inp))
    return QuantizedMatrix(codes, _bf16_exact(scales), 4, group, (out, inp))


def random_layer(shape: ExpertShape, n: int, seed: int):
    """`n` random experts: (gate_up [2I, H], down [H, I]) QuantizedMatrix lists."""
    g = _generator(seed, shape.name, "weights")
    gate_up = [random_int4(2 * shape.inter, shape.hidden, g) for _ in range(n)]
    down = [random_int4(shape.hidden, shape.inter, g) for _ in range(n)]
    return gate_up, down


def compact(index: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """Real expert ids -> ranks in `experts` (sorted), so only routed experts need weights;
    the order of experts, and so every backend's summation order, is unchanged."""
    lut = torch.full((max(experts) + 1,), -1, dtype=torch.int64)
    lut[torch.tensor(experts)] = torch.arange(len(experts))
    return lut[index]


def _with(qm: QuantizedMatrix, dtype: torch.dtype, device: torch.device) -> QuantizedMatrix:
    return QuantizedMatrix(qm.codes.to(device), qm.scales.to(device=device, dtype=dtype), qm.bits,
                           qm.group, qm.shape)


# ------------------------------------------------------------------------- target experts
def target_experts(hidden, index, weights, expert_weights, act=_act, serial=False) -> torch.Tensor:
    """The target's routed experts exactly as `OffloadRuntime.experts_forward` computes them
    (its own `expert_output` and `sum_in_expert_order`), with `expert_weights(e)` giving
    (gate_up, down)."""
    groups = group_by_expert(index, int(index.max()) + 1)
    outs = {e: expert_output(hidden, groups.of(e), weights, *expert_weights(e), act, serial)
            for e in groups.needed}
    return sum_in_expert_order(hidden, outs, groups.needed)


def target_grouped(hidden, index, weights, expert_weights, act=_act) -> torch.Tensor:
    """One GEMM per expert over all its tokens (SEE's verification reordering)."""
    return target_experts(hidden, index, weights, expert_weights, act)


def target_serial(hidden, index, weights, expert_weights, act=_act) -> torch.Tensor:
    """One GEMV per (token, expert): the runtime's `serial` ablation, same summation order."""
    return target_experts(hidden, index, weights, expert_weights, act, serial=True)


class _PooledReference:
    """`ReferenceExperts`' routing and summation over already dequantized fp32 weights, expert
    e taking pool entry e % len(pool) (as the target paths do)."""

    def __init__(self, pool, gate_up, down):
        from specter.quant import kernels

        self.pool = pool
        self.ref = kernels.ReferenceExperts(gate_up, down, _act)
        self.ref.expert = self.expert

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.pool[e % len(self.pool)]
        h = _act(nn.functional.linear(x, gate_up.to(x.dtype)))
        return nn.functional.linear(h, down.to(x.dtype))

    def __call__(self, hidden, index, weights):
        return self.ref(hidden, index, weights)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    out, ref = out.float().cpu(), ref.float().cpu()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def tolerance(dtype: torch.dtype, device: torch.device, fused: bool = False) -> float:
    """Agreement required before a time is reported: fp32 rounding for fp32 (the fused kernel's
    tl.dot may use TF32 on CUDA), bf16/fp16 rounding of activations and intermediates."""
    if dtype == torch.float32:
        return 5e-3 if (fused and device.type == "cuda") else 1e-3
    return 3e-2
