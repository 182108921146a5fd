"""Running a model whose routed experts live only in its host store, before (or without) the
offloading runtime: each expert a layer's router chose is read from its host copy for that
one call (copied to the device beside a GPU, used, dropped), and the layer's outputs are
summed in expert order as the runtime and HF's eager loop do, so the outputs are those of
the model with its experts resident.

Owns: the `specter_streamed` experts implementation a model loaded with its experts in host
memory runs under until the runtime adopts it (GPTQ's calibration forwards, MO-SM's default
vectors, the emulated clock's time scale, a plain `generate`).
Does not own: residency, prefetching or timing (the runtime's: offload/runtime.py).
"""

from __future__ import annotations

from torch import nn

from specter.grouping import group_by_expert
from specter.models.introspect import experts_modules
from specter.offload.runtime import expert_output, sum_in_expert_order
from specter.offload.store import HostExpertStore

IMPL_NAME = "specter_streamed"


def _streamed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    store: HostExpertStore = self._specter_streamed_store
    l = self._specter_streamed_layer
    outs = {}
    groups = group_by_expert(top_k_index, store.layout.num_experts)
    for e in groups.needed:
        gate_up, down = store.weights(l, e, hidden_states.device)
        outs[e] = expert_output(hidden_states, groups.of(e), top_k_weights, gate_up, down,
                                self._apply_gate)
    return sum_in_expert_order(hidden_states, outs, groups.needed)


def stream_from(model: nn.Module, store: HostExpertStore) -> None:
    """Run `model`'s routed experts from `store` (its experts modules keep their fused
    shapes on `meta`, holding no weights)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPL_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, _streamed_experts_forward)
    for l, (_, m) in enumerate(experts_modules(model)):
        m._specter_streamed_store, m._specter_streamed_layer = store, l
    model.config._experts_implementation = IMPL_NAME
