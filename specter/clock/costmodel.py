"""The cost model of the modelled hardware: seconds for each compute step and each transfer.

Owns: hardware profiles (matrix rate, memory bandwidth, launch overhead, H2D link, and an
engine's framework costs: per decoder layer and per MLP call, zero for the ideal roofline,
calibrated to public measurements of eager decoding for the `*_hf` profiles, see
docs/calibration.md), the
charged sizes of one decoder layer by role (attention, router, shared experts, dense MLP,
one routed expert, lm head), and the roofline arithmetic that turns (role, tokens, context)
into seconds. The virtual clock advances by these numbers; nothing here runs a model.
Does not own: when a step happens (the offloading runtime charges steps as they run).

Charged sizes come from the modelled model itself ("own") or from the real model a
project-made model stands for ("real": the real config is instantiated on the meta device,
no weights). With real sizes, each modelled layer stands for several real ones, by role:
attention (and norms) by `attn_multiplier = real layers / modelled layers`, the MoE block
(router, shared experts, routed experts and their transfer bytes) by
`moe_multiplier = real MoE layers / modelled MoE layers`, a dense MLP by
`dense_multiplier = real dense layers / modelled dense layers` (if the modelled model has no
dense layer but the real one has, their cost is charged with the lm head). A simulated TPOT
so lands on the real model's scale while routing and tokens still come from the small model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from specter.models.introspect import experts_modules, is_experts_module


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    matrix_flops: float  # dense fp16 matrix FLOP/s
    mem_bandwidth_Bps: float  # device memory bytes/s
    launch_overhead_s: float  # per kernel
    h2d_bandwidth_Bps: float  # host-to-device link bytes/s
    h2d_latency_s: float  # per transfer
    host_matrix_flops: float = 0.0  # the host CPU's FLOP/s (experts computed on the host)
    host_mem_bandwidth_Bps: float = 0.0  # host memory bytes/s
    # Framework costs of an eager engine (0 for the ideal roofline; docs/calibration.md):
    layer_overhead_s: float = 0.0  # per decoder layer per forward (attention, norms, router glue)
    expert_overhead_s: float = 0.0  # per MLP call: a routed/shared expert, a dense MLP
    engine: str = "ideal"  # "ideal" | "hf"
    draft_overhead_s: float | None = None  # per fused INT4 draft layer; None: expert_overhead_s
    offload_layer_overhead_s: float = 0.0  # per offloaded MoE layer per forward (host side)
    # Counted host costs (specter/clock/counted.py): per launching op, per host sync
    host_op_s: float = 0.0
    sync_s: float = 0.0
    # The device's per-kernel floor (docs/clocks.md, "The kernel floor"): each kernel it runs
    # costs this beside its roofline time (a captured graph's are counted at capture)
    kernel_floor_s: float = 0.0

    @property
    def counted(self) -> bool:
        """Host costs charged from what the code issues, not as per-layer constants."""
        return self.host_op_s > 0 or self.sync_s > 0

    def captured(self) -> "HardwareProfile":
        """This device running a captured CUDA graph (a compiled step, `spec.compile`): no
        per-kernel launch and no eager framework cost inside it, only its kernels' compute and
        memory time; the replay's one launch and its kernels' floors (`kernel_floor_s` each)
        are charged by `ComputeClock.captured_step`."""
        return replace(self, launch_overhead_s=0.0, layer_overhead_s=0.0, expert_overhead_s=0.0,
                       draft_overhead_s=None, offload_layer_overhead_s=0.0)


@dataclass(frozen=True)
class ChargedSizes:
    """Parameter counts of one decoder layer by role, at `elem_bytes` per parameter."""

    source: str  # "own:<model>" or "real:<hub id>"
    elem_bytes: int
    attn_params: int
    router_params: int
    shared_params: int
    dense_mlp_params: int
    expert_params: int  # one routed expert (gate, up, down)
    lm_head_params: int
    kv_elems_per_token: int  # K+V elements one token adds in one layer
    heads: int
    head_dim: int
    attn_multiplier: float = 1.0
    moe_multiplier: float = 1.0
    dense_multiplier: float = 1.0
    unmodelled_dense_layers: int = 0  # real dense layers with no modelled counterpart
    hidden: int = 0  # the residual width: bytes of a token's activations / elem_bytes
    # Quantized weights as a publication deploys them (0: `elem_bytes` per parameter): the
    # routed experts' and the attention's bits per weight, with one scale and one zero per
    # group of `quant_group` weights at `quant_meta_bytes` for both (HQQ's and GPTQ's layouts).
    expert_bits: int = 0
    attn_bits: int = 0
    quant_group: int = 64
    quant_meta_bytes: int = 4
    attn_quant_group: int = 0  # the attention's group size where it differs (0: quant_group)

    def _bytes(self, params: int, bits: int, group: int) -> int:
        if not bits:
            return params * self.elem_bytes
        return int(params * bits // 8 + -(-params // group) * self.quant_meta_bytes)

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights as charged (moved over the link, read from memory)."""
        return self._bytes(self.expert_params, self.expert_bits, self.quant_group)

    @property
    def attn_bytes(self) -> int:
        """One layer's attention (and norms) weights as charged."""
        return self._bytes(self.attn_params, self.attn_bits, self.attn_quant_group or self.quant_group)

    def as_record(self) -> dict:
        return {f"charged.{k}": v for k, v in asdict(self).items()}


def layer_roles(layer: nn.Module) -> dict[str, int]:
    """Parameter counts of one decoder layer split by role (generic over architectures)."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    roles = {"attn": 0, "router": 0, "shared": 0, "dense_mlp": 0, "experts": 0}
    for name, child in layer.named_children():
        if name == "mlp" and any(is_experts_module(m) for m in child.modules()):
            for sub_name, sub in child.named_children():
                if is_experts_module(sub):
                    roles["experts"] += count(sub)
                elif sub_name.startswith("shared_expert"):
                    roles["shared"] += count(sub)
                else:
                    roles["router"] += count(sub)
        elif name == "mlp":
            roles["dense_mlp"] += count(child)
        else:  # attention and norms
            roles["attn"] += count(child)
    return roles


def layer_counts(model: nn.Module) -> tuple[int, int, int]:
    """(decoder layers, MoE layers, dense-MLP layers)."""
    layers, moe = len(model.model.layers), len(experts_modules(model))
    return layers, moe, layers - moe


def charged_sizes(model: nn.Module, source: str, elem_bytes: int,
                  modelled: tuple[int, int, int] | None = None) -> ChargedSizes:
    """Sizes of `model`; `modelled` = layer_counts of the model whose layers run, if another."""
    cfg = model.config
    layers = model.model.layers
    moe = experts_modules(model)
    moe_idx, experts = moe[0]
    dense = [i for i in range(len(layers)) if i not in {j for j, _ in moe}]
    moe_roles = layer_roles(layers[moe_idx])
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if getattr(cfg, "kv_lora_rank", None) is not None:  # MLA as HF caches it: full K and V
        kv = kv_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    else:
        kv = 2 * kv_heads * head_dim
    return ChargedSizes(
        source=source, elem_bytes=elem_bytes, attn_params=moe_roles["attn"],
        router_params=moe_roles["router"], shared_params=moe_roles["shared"],
        dense_mlp_params=layer_roles(layers[dense[0]])["dense_mlp"] if dense else 0,
        expert_params=experts.gate_up_proj[0].numel() + experts.down_proj[0].numel(),
        lm_head_params=model.lm_head.weight.numel(), kv_elems_per_token=kv, heads=heads,
        head_dim=head_dim, hidden=cfg.hidden_size, **_multipliers(layer_counts(model), modelled))


def _multipliers(real: tuple[int, int, int], modelled: tuple[int, int, int] | None) -> dict:
    if modelled is None:
        return {}
    (rl, rm, rd), (ml, mm, md) = real, modelled
    return {"attn_multiplier": rl / ml, "moe_multiplier": rm / mm,
            "dense_multiplier": rd / md if md else 0.0,
            "unmodelled_dense_layers": 0 if md else rd}


def real_charged_sizes(real_config: dict, modelled: tuple[int, int, int],
                       elem_bytes: int = 2) -> ChargedSizes:
    """Sizes of a real model from its config alone (meta device: no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**real_config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    return charged_sizes(meta, f"real:{real_config.get('_name_or_path', cfg.model_type)}",
                         elem_bytes, modelled)


class CostModel:
    """Roofline seconds for the compute steps of a decode/verify forward."""

    def __init__(self, hw: HardwareProfile, sizes: ChargedSizes):
        self.hw, self.sizes = hw, sizes

    def matmul_s(self, tokens: int, params: int, kernels: int = 1,
                 weight_bytes: int | None = None) -> float:
        """tokens x params GEMM/GEMV: max(compute, weight traffic) + launches; `weight_bytes`:
        the weights' bytes where they are not `elem_bytes` a parameter (quantized)."""
        if params == 0:
            return 0.0
        flops = 2.0 * tokens * params
        traffic = params * self.sizes.elem_bytes if weight_bytes is None else weight_bytes
        return max(flops / self.hw.matrix_flops, traffic / self.hw.mem_bandwidth_Bps) \
            + kernels * self.hw.launch_overhead_s

    def attention_s(self, tokens: int, context: int) -> float:
        """Projections and norms, plus reading the KV cache of `context` positions."""
        return self.attention_batch_s([(tokens, context)])

    def attention_batch_s(self, rows: list[tuple[int, int]]) -> float:
        """One batched attention forward: `rows` holds (tokens, context) per sequence. The
        projections run once over every row's tokens (weights read once); each sequence reads
        its own KV cache and scores its own tokens against it."""
        s = self.sizes
        tokens = sum(t for t, _ in rows)
        proj = self.matmul_s(tokens, s.attn_params, kernels=6, weight_bytes=s.attn_bytes)
        kv_read = sum(c for _, c in rows) * s.kv_elems_per_token * s.elem_bytes \
            / self.hw.mem_bandwidth_Bps
        scores = 4.0 * sum(t * c for t, c in rows) * s.heads * s.head_dim / self.hw.matrix_flops
        # The framework's per-layer cost is charged here, once per decoder layer and forward.
        return (proj + max(kv_read, scores) + self.hw.layer_overhead_s) * self.sizes.attn_multiplier

    def router_s(self, tokens: int) -> float:
        return self.matmul_s(tokens, self.sizes.router_params, kernels=2) * self.sizes.moe_multiplier

    def mlp_call_s(self, tokens: int, params: int, weight_bytes: int | None = None) -> float:
        """One MLP call (gate_up GEMM, activation, down GEMM) plus the framework's per-call cost."""
        if params == 0:
            return 0.0
        return self.matmul_s(tokens, params, kernels=3, weight_bytes=weight_bytes) \
            + self.hw.expert_overhead_s

    def shared_s(self, tokens: int) -> float:
        return self.mlp_call_s(tokens, self.sizes.shared_params) * self.sizes.moe_multiplier

    def dense_mlp_s(self, tokens: int) -> float:
        return self.mlp_call_s(tokens, self.sizes.dense_mlp_params) * self.sizes.dense_multiplier

    def expert_s(self, tokens: int) -> float:
        """One routed expert over `tokens` tokens (gate_up GEMM, activation, down GEMM)."""
        s = self.sizes
        return self.mlp_call_s(tokens, s.expert_params, s.expert_bytes) * s.moe_multiplier

    # launching operations of one round of the offload runtime's fixed-launch kernel
    # (offload/grouped.py: upload, gathers, two GEMMs, the gate, the weights, the place)
    GROUPED_LAUNCHES = 10

    def grouped_experts_s(self, tokens_per_expert: list[int]) -> float:
        """One round of a layer's resident experts in the runtime's fixed-launch kernel: every
        expert's FLOPs and weights in one pass (max of the two), its launches, and one
        framework call (not one per expert: offload/runtime.py `_rounds`)."""
        s = self.sizes
        flops = sum(2.0 * n * s.expert_params for n in tokens_per_expert)
        traffic = len(tokens_per_expert) * s.expert_bytes
        seconds = max(flops / self.hw.matrix_flops, traffic / self.hw.mem_bandwidth_Bps) \
            + self.GROUPED_LAUNCHES * self.hw.launch_overhead_s + self.hw.expert_overhead_s
        return seconds * s.moe_multiplier

    def draft_experts_s(self, tokens_per_expert: list[int], bits: int = 4, group: int = 128,
                        dequantized: bool = False) -> float:
        """One MoE layer's routed experts from their quantized copy in one fused kernel (SEE:
        the Triton kernel is one launch per projection, plus the activation): every routed
        expert's FLOPs and `bits`-bit weights (plus one 2-byte scale per group), three launches.
        `dequantized`: the backend writes each (token, expert) pair's weights out at the
        model's width and reads them back for its GEMM (gather_int4: the draft step that
        compiles and captures whole), so each pair also moves 2 x `elem_bytes` a weight."""
        p = self.sizes.expert_params
        flops = sum(2.0 * n * p for n in tokens_per_expert)
        traffic = len(tokens_per_expert) * (p * bits / 8 + p / group * 2)
        if dequantized:
            pairs = sum(tokens_per_expert)
            traffic = pairs * (p * bits / 8 + p / group * 2 + 2 * p * self.sizes.elem_bytes)
        seconds = max(flops / self.hw.matrix_flops, traffic / self.hw.mem_bandwidth_Bps) \
            + 3 * self.hw.launch_overhead_s + self.draft_call_overhead_s()
        return seconds * self.sizes.moe_multiplier

    def draft_call_overhead_s(self) -> float:
        """The framework cost of one fused draft layer call (one MLP call unless measured)."""
        d = self.hw.draft_overhead_s
        return self.hw.expert_overhead_s if d is None else d

    def kernels_s(self, kernels: int) -> float:
        """The device's floor for `kernels` kernels run back to back (a captured graph's, of
        this model's step): with real sizes, a modelled layer's kernels stand for those of the
        `attn_multiplier` real layers it stands for (the step's few outside the layers too,
        an over-count of a few kernels in a thousand)."""
        return kernels * self.hw.kernel_floor_s * self.sizes.attn_multiplier

    def offload_layer_s(self, tokens: int = 1) -> float:
        """The offload runtime's host cost for one MoE layer of one forward, whatever its
        `tokens` (the routing read back, residency decisions, copies issued and waited on)."""
        return self.hw.offload_layer_overhead_s * self.sizes.moe_multiplier

    def host_expert_s(self, tokens: int) -> float:
        """One routed expert computed on the host CPU from its full-precision host copy
        (SpecMoE's draft): the same roofline against the host's rate and memory bandwidth."""
        if not (self.hw.host_matrix_flops > 0 and self.hw.host_mem_bandwidth_Bps > 0):
            raise ValueError(f"hardware {self.hw.name} has no host profile "
                             "(host_matrix_flops, host_mem_bandwidth_Bps)")
        p = self.sizes.expert_params
        seconds = max(2.0 * tokens * p / self.hw.host_matrix_flops,
                      self.sizes.expert_bytes / self.hw.host_mem_bandwidth_Bps) \
            + self.hw.expert_overhead_s
        return seconds * self.sizes.moe_multiplier

    def host_expert_job_s(self, tokens: int) -> float:
        """A routed expert computed on the host for `tokens` tokens (`host_expert_s`) plus its
        activations' round trip over the link: the tokens' inputs down and outputs back,
        each one transfer of tokens x hidden elements (per real layer a modelled one stands for)."""
        return self.host_expert_s(tokens) + self.activation_trip_s(tokens)

    def activation_trip_s(self, tokens: int) -> float:
        """`tokens` activations down the link and their outputs back: two transfers of tokens
        x hidden elements (per real layer a modelled one stands for)."""
        act = tokens * self.sizes.hidden * self.sizes.elem_bytes
        return 2 * (act / self.hw.h2d_bandwidth_Bps + self.hw.h2d_latency_s) * self.sizes.moe_multiplier

    def host_layer_job_s(self, counts: list[int], tokens: int) -> float:
        """Every routed expert of one MoE layer on the host (system=host_experts): each expert
        over its `counts` tokens (`host_expert_s`: its weights stream once at batch 1, its
        FLOPs bound as tokens grow), plus one round trip of the layer's `tokens` activations
        over the link (inputs down, the summed output back)."""
        return sum(self.host_expert_s(n) for n in counts) + self.activation_trip_s(tokens)

    def lm_head_s(self, tokens: int) -> float:
        """The lm head, plus any real dense MLP layers the modelled model lacks."""
        s = self.sizes
        unmodelled = s.unmodelled_dense_layers * self.mlp_call_s(tokens, s.dense_mlp_params)
        return self.matmul_s(tokens, s.lm_head_params) + unmodelled

    def expert_transfer_bytes(self) -> int:
        """Bytes the link is charged for one modelled expert move."""
        return int(round(self.sizes.expert_bytes * self.sizes.moe_multiplier))

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.hw.h2d_bandwidth_Bps + self.hw.h2d_latency_s
