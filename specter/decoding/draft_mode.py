"""The self-draft: one model instance, two precisions (its INT4 draft and its full-precision
target), and the memory account of sharing the instance against two separate models.

Owns: the draft's layers (the same layers' routed experts from their INT4 copy on the
device) and their listeners, and the memory accounting of the shared instance against two
separate models. A model is in `target` mode (routed experts as the target runs them: Hugging
Face's own code, or the offloading runtime) or `draft` mode (these layers); the switch is the
experts dispatcher's (specter/experts.py `Experts.drafting`), which `draft()` is.
Everything but the routed experts (embeddings, attention, norms, routers, shared experts, lm
head) is the same tensors in both modes: there is one model object and no copy.
Does not own: quantization (calibrate.py), kernels (kernels.py), speculation (decoding/loop.py).

Use: `sw = DraftMode(model, quantized, backend)`; `with sw.draft(): model(...)`. It takes the
draft seat of the model's experts dispatcher (specter/experts.py); target mode runs whatever
holds the target seat (HF's own, or an offload runtime attached before or after).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from specter.experts import experts_of
from specter.models.introspect import experts_modules
from specter.switch import switched
from specter.quant.calibrate import QuantizedExperts
from specter.quant.formats import draft_expert_bytes
from specter.quant.kernels import GraphedExperts, layers_nbytes, make_experts

class DraftMode:
    """Switches one model between its target experts and their draft (the INT4 copy, or any
    other per-layer draft experts): `with draft_mode.draft(): model(...)` drafts."""

    def __init__(self, model: nn.Module, quantized: QuantizedExperts | None,
                 backend: str = "reference", device: torch.device | None = None,
                 draft_layers: list | None = None, draft_bytes: int = 0, graphs: bool = False,
                 mode: str = "target"):
        """`quantized`: the INT4 copy the draft runs; or `draft_layers` (one callable per MoE
        layer, (hidden, top_k_index, top_k_weights) -> out) with their `draft_bytes` on the
        device, for a draft that runs its experts some other way. `graphs`: each draft layer
        replayed as a CUDA graph (quant/step_form.py draft_step_form). `mode`: the one it starts in
        ("draft" for a second instance that is only ever the draft)."""
        self.model, self.quantized, self.backend = model, quantized, backend
        mods = [m for _, m in experts_modules(model)]
        self.device = device or next(model.parameters()).device
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        if draft_layers is not None:
            self.draft_layers, self.draft_bytes = draft_layers, draft_bytes
        else:
            # Layer by layer to the device, in the backend's layout: one device copy of the
            # draft (`quantized` stays where it is, the host after a quantization).
            self.draft_layers = [make_experts(backend, quantized.gate_up[l], quantized.down[l],
                                              m._apply_gate, dtype, device=self.device,
                                              graphs=graphs)
                                 for l, m in enumerate(mods)]
            # what the backend's layers hold, in their layout (cuda_int4's bf16 scales and
            # zeros included), not the quantized format's packed size
            self.draft_bytes = layers_nbytes(self.draft_layers)
        # The draft seat of the one dispatcher (specter/experts.py), whose mode says who
        # computes: `with draft_mode.draft():` is the dispatcher's own switch.
        self.experts = experts_of(model)
        self.experts.draft = self
        self.experts.mode = mode
        self.draft = self.experts.drafting
        # Told of each draft experts call as (moe_layer, top_k_index [T, k]): the virtual
        # clock's charge, the orchestrator's lookahead buffer.
        self.draft_listeners: list = []
        # A listener's form for every layer at once (routes [L, T, k]), used after a compiled
        # step (`replay`): one call per step, not one per MoE layer (`listen`'s `all_layers`).
        self.all_layers: dict = {}
        # Listeners whose every-layer form is device work on tensors they keep in place (the
        # lookahead buffer's scatter): a step captured as a CUDA graph runs them inside it
        # (`in_graph`), and `replay(captured=True)` leaves them out.
        self.graph_safe: list = []
        # Inside a compiled draft step (compiled_draft.py) the listeners do not run: each layer's
        # routing is kept in `routes` and `replay` tells them after the step.
        self.capture = False
        self.routes: list = []

    def forward(self, layer: int, hidden_states, top_k_index, top_k_weights):
        """MoE layer `layer`'s routed experts as the draft computes them (the dispatcher calls
        it in draft mode): its listeners hear the routing first (or, inside a compiled step,
        it is kept in `routes` for `replay`)."""
        if self.capture:
            self.routes.append(top_k_index)
        else:
            for listener in self.draft_listeners:
                listener(layer, top_k_index)
        return self.draft_layers[layer](hidden_states, top_k_index, top_k_weights)

    @property
    def mode(self) -> str:
        """The dispatcher's mode: "target", or "draft" inside `draft()`."""
        return self.experts.mode

    @mode.setter
    def mode(self, value: str) -> None:
        self.experts.mode = value

    def capturing(self):
        """Draft layers keep their routing in `routes` instead of telling the listeners."""
        return switched(self, "capture", True, self)

    def listen(self, fn, all_layers=None, in_graph: bool = False) -> None:
        """`fn(layer, top_k_index)` hears each draft MoE layer; `all_layers(routes)`, when
        given, hears a compiled step's every layer in one call instead; `in_graph`: that call
        is device work only, on tensors kept in place, so a captured step runs it inside its
        CUDA graph."""
        self.draft_listeners.append(fn)
        if all_layers is not None:
            self.all_layers[fn] = all_layers
            if in_graph:
                self.graph_safe.append(fn)

    def in_graph(self, routes) -> None:
        """The graph-safe listeners' every-layer calls (issued while a step is captured)."""
        for listener in self.graph_safe:
            if listener in self.draft_listeners:
                self.all_layers[listener](routes)

    def replay(self, routes, captured: bool = False) -> None:
        """Tell the listeners of a compiled step's routing (`routes[l]`: MoE layer l's
        top_k_index): those with an every-layer form once, the others layer by layer in layer
        order as the eager forward does. `captured`: the step was a CUDA graph's replay, which
        ran the graph-safe listeners already."""
        per_layer = []
        for listener in self.draft_listeners:
            whole = self.all_layers.get(listener)
            if captured and listener in self.graph_safe:
                continue
            if whole is not None:
                whole(routes)
            else:
                per_layer.append(listener)
        if per_layer:
            for layer, top_k_index in enumerate(routes.unbind(0)):
                for listener in per_layer:
                    listener(layer, top_k_index)

    def warm_graphs(self, lengths) -> int:
        """Capture the per-layer CUDA graphs (quant.graphs: `GraphedExperts`) of draft forwards
        of each of `lengths` tokens now, at build time, so that no capture (each one
        synchronizes the device, and the first compiles Triton's kernel) falls in a timed
        window: one draft forward of each length, over no cache, its listeners muted. A
        layer captures only the shapes its backend runs with no host read
        (`GraphedExperts.captures`); the others run eagerly, here and while decoding.
        Returns the captures made."""
        graphed = [layer for layer in self.draft_layers if isinstance(layer, GraphedExperts)]
        if not graphed:
            return 0
        before = sum(len(layer.graphs) for layer in graphed)
        listeners, self.draft_listeners = self.draft_listeners, []
        try:
            with torch.no_grad(), self.draft():
                for t in sorted({t for t in lengths if 0 < t <= graphed[0].max_tokens}):
                    ids = torch.zeros(1, t, dtype=torch.long, device=self.device)
                    self.model(input_ids=ids, use_cache=False)
        finally:
            self.draft_listeners = listeners
        return sum(len(layer.graphs) for layer in graphed) - before


@dataclass(frozen=True)
class MemoryAccount:
    """Device bytes of a draft + target pair, shared instance vs two separate models."""

    source: str
    non_expert_bytes: int  # embeddings, attention, norms, routers, shared experts, head
    draft_expert_bytes: int  # every routed expert at INT4 (codes + scales)
    target_slot_bytes: int  # the target's resident expert slots
    kv_bytes: int  # one KV cache at `context` tokens
    context: int

    @property
    def shared_bytes(self) -> int:  # one instance: one copy of the rest, one KV cache
        return self.non_expert_bytes + self.draft_expert_bytes + self.target_slot_bytes + self.kv_bytes

    @property
    def separate_bytes(self) -> int:  # a draft model and a target model, each with its KV
        return 2 * self.non_expert_bytes + self.draft_expert_bytes + self.target_slot_bytes \
            + 2 * self.kv_bytes

    @property
    def saving(self) -> float:
        return 1 - self.shared_bytes / self.separate_bytes

    def as_record(self) -> dict:
        rec = {f"mem.{k}": v for k, v in asdict(self).items()}
        rec.update({"mem.shared_bytes": self.shared_bytes, "mem.separate_bytes": self.separate_bytes,
                    "mem.saving": self.saving})
        return rec


def account_model(source: str, spec, slots: int, context: int, draft_bytes: int | None = None,
                  group: int = 128) -> MemoryAccount:
    """From an `MoESpec` (measured tensors of a loaded model, or a real config on meta)."""
    n_moe = spec.num_moe_layers
    if draft_bytes is None:
        draft_bytes = n_moe * spec.num_experts * draft_expert_bytes(
            spec.hidden, spec.expert_inter, 4, group, 2)
    return MemoryAccount(source=source, non_expert_bytes=spec.non_expert_bytes,
                         draft_expert_bytes=draft_bytes,
                         target_slot_bytes=spec.slot_bytes(slots),
                         kv_bytes=spec.kv_bytes_per_token * context, context=context)
