"""Running a model whose routed experts live only in its host store, before (or without) the
offloading runtime: each expert a layer's router chose is read from its host copy for that
one call (copied to the device beside a GPU, used, dropped), and the layer's outputs are
summed in expert order as the runtime and HF's eager loop do, so the outputs are those of
the model with its experts resident.

Owns: the target a model loaded with its experts in host
memory runs under until the runtime adopts it (GPTQ's calibration forwards, MO-SM's default
vectors, the emulated clock's time scale, a plain `generate`).
Does not own: residency, prefetching or timing (the runtime's: offload/runtime.py).
"""

from __future__ import annotations

from torch import nn

from specter.experts import experts_of
from specter.grouping import group_by_expert
from specter.offload.mlp import expert_output, sum_in_expert_order
from specter.offload.store import HostExpertStore


def stream_from(model: nn.Module, store: HostExpertStore) -> None:
    """Run `model`'s routed experts from `store` (its experts modules keep their fused
    shapes on `meta`, holding no weights): the target seat of its experts dispatcher
    (specter/experts.py)."""

    def streamed(layer, module, hidden_states, top_k_index, top_k_weights):
        outs = {}
        groups = group_by_expert(top_k_index, store.layout.num_experts)
        for e in groups.needed:
            gate_up, down = store.weights(layer, e, hidden_states.device)
            outs[e] = expert_output(hidden_states, groups.of(e), top_k_weights, gate_up, down,
                                    module._apply_gate)
        return sum_in_expert_order(hidden_states, outs, groups.needed)

    experts_of(model).target = streamed
