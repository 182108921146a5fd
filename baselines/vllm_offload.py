"""`system=vllm_offload`: vLLM's `cpu_offload_gb`, modelled: the weights that do not fit the
device stay in pinned host memory and are read over the link in every forward.

vLLM offloads by bytes, not by experts: `maybe_offload_to_cpu` walks the decoder layers in
order (layer 0 first) and moves each parameter to pinned host memory until `cpu_offload_gb`
is reached; the rest stays on the device. Two generations of vLLM then read the offloaded
parameters differently, and `system.reads` picks one:

- `touched` (the default; vLLM's UVA offloader): the device gets a CUDA view of the host
  tensor (unified virtual addressing) and its kernels read through the link only what they
  touch: an offloaded layer's attention, norms, router and shared experts in full, and of its
  routed experts only those the forward's tokens chose (a fused MoE kernel reads the weights
  of the experts that have tokens);
- `all` (vLLM before it: `functional_call` with `state_dict().to(device)` around each
  offloaded layer's forward): every offloaded byte of the layer crosses the link in every
  forward.

Nothing of this overlaps the layer's own compute (the kernel waits on its reads, or the layer
on its copy), so each offloaded layer's bytes are charged on the shared link as one transfer
waited for at once, before its experts run. `cpu_offload_gb` comes from the run's device GiB
(`budget.gb`, else the named budget's reference GiB): every FP16 weight of the model the
bytes are of (the real one a project-made model stands for), its KV cache and the reserve,
minus the GiB (specter/budget.py). With real sizes charged, the modelled layers stand for the
real ones: real MoE layer j is charged with the routing of modelled MoE layer j * M // R, and
the real dense layers (first, as in DeepSeek-V2) with the first modelled MoE layer.

Decoding is plain greedy over every weight (the engine is `resident`'s), so the tokens are
the target's own by construction. The cost model should be the optimised engine's
(`hardware=a100_pcie4_ideal`): vLLM decodes under CUDA graphs. Real vLLM on a GPU is not run
here (`vllm` is an optional GPU extra); this models its data movement on the virtual clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specter.budget import Footprint
from specter.config import SystemConfig
from specter.counting import charging_only
from specter.decoding.engines import GreedyEngine
from specter.errors import UserError
from specter.models.introspect import experts_modules
from specter.clock.timing import timing_for

ENGINE = GreedyEngine
FOOTPRINT = Footprint(offloads_weights=True)
LOADS_EXPERTS = "device"  # the model runs whole; the offloaded bytes are charged, not moved
READS = ("touched", "all")


@dataclass
class Config(SystemConfig):
    reads: str = "touched"  # touched (UVA: what the kernels read) | all (every offloaded byte)

    def validate(self) -> None:
        if self.reads not in READS:
            raise UserError(f"system.reads must be one of {', '.join(READS)} (got '{self.reads}').")


class OffloadedReads:
    """Forward pre-hooks on the experts modules charging, per forward, the bytes the offloaded
    decoder layers read over the link (the module docstring's rule)."""

    def __init__(self, model, timing, share: float, reads: str = "touched"):
        self.link, self.reads = timing.link, reads
        s = timing.cost.sizes
        moe = experts_modules(model)
        self.num_experts = moe[0][1].gate_up_proj.shape[0]
        m_moe, m_dense = len(moe), len(model.model.layers) - len(moe)
        r_moe = max(1, round(s.moe_multiplier * m_moe))
        r_dense = round(s.dense_multiplier * m_dense) if m_dense else s.unmodelled_dense_layers
        self.expert_bytes = s.expert_bytes
        self.dense_bytes = (s.attn_params + s.dense_mlp_params) * s.elem_bytes
        self.moe_fixed = (s.attn_params + s.router_params + s.shared_params) * s.elem_bytes
        moe_bytes = self.moe_fixed + self.num_experts * self.expert_bytes
        layers = [self.dense_bytes] * r_dense + [moe_bytes] * r_moe  # dense layers first
        left, shares = share * sum(layers), []
        for b in layers:  # first layers first: each layer's offloaded share
            shares.append(min(1.0, max(0.0, left / b)) if b else 0.0)
            left -= shares[-1] * b
        self.dense_share = sum(shares[:r_dense])
        moe_shares = shares[r_dense:]
        self.per_layer = [[sh for j, sh in enumerate(moe_shares) if j * m_moe // r_moe == m]
                          for m in range(m_moe)]
        self.offloaded_bytes = int(round(sum(sh * b for sh, b in zip(shares, layers))))
        self.read_bytes = 0  # charged this request
        self.handles = [module.register_forward_pre_hook(self._hook(m))
                        for m, (_, module) in enumerate(moe)]

    def bytes_for(self, m: int, distinct: int) -> int:
        """The bytes modelled MoE layer `m`'s real layers read in one forward that routes its
        tokens to `distinct` experts (the real dense layers ride on layer 0)."""
        experts = self.num_experts if self.reads == "all" else distinct
        per_layer = self.moe_fixed + experts * self.expert_bytes
        total = sum(sh * per_layer for sh in self.per_layer[m])
        if m == 0:
            total += self.dense_share * self.dense_bytes
        return int(round(total))

    def _hook(self, m: int):
        def charge(module, args):
            top_k_index = args[1]
            with charging_only():  # the routing read only prices the modelled link
                distinct = int(torch.unique(top_k_index).numel())
            nbytes = self.bytes_for(m, distinct)
            if nbytes:
                self.read_bytes += nbytes
                self.link.wait(self.link.copy(_SCRATCH, _SCRATCH, nbytes=nbytes))
        return charge

    def as_record(self) -> dict:
        return {"vllm_offloaded_bytes": self.offloaded_bytes, "vllm_reads": self.reads,
                "vllm_read_bytes": self.read_bytes}


_SCRATCH = torch.zeros(1)


class VllmOffloadEngine(GreedyEngine):
    """Greedy decoding with the offloaded layers' reads charged on the link."""

    def __init__(self, job, timing, reads: OffloadedReads):
        super().__init__("vllm_offload", job.loaded.model, job.device, timing,
                         stop_on_eos=job.stop_on_eos)
        self.reads = reads

    def reset(self) -> None:
        super().reset()
        self.reads.read_bytes = 0

    def _decode(self, prompts, max_new_tokens, on_commit=None):
        """GreedyEngine's decode (`generate`'s `on_commit` streamed by it), plus the reads."""
        gens = super()._decode(prompts, max_new_tokens, on_commit)
        for g in gens:
            g.stats.update(self.reads.as_record())
        return gens


def build(job) -> VllmOffloadEngine:
    timing = timing_for(job)
    if timing.cost is None or not timing.kind.modelled:
        raise UserError("system=vllm_offload models vLLM's cpu_offload_gb on a modelled clock: "
                        "use a GPU profile, e.g. hardware=a100_pcie4_ideal (vLLM decodes under "
                        "CUDA graphs: the optimised engine).")
    share = job.budget.offload_share
    return VllmOffloadEngine(job, timing, OffloadedReads(job.loaded.model, timing, share,
                                                         job.system.reads))
