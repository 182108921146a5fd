"""Who computes each routed-experts call: one dispatcher, registered once.

transformers runs a MoE layer's routed experts through the function its experts registry holds
under `config._experts_implementation` (`use_experts_implementation`): the experts module's
forward becomes `fn(module, hidden, top_k_index, top_k_weights)`. Specter registers one such
function, `dispatch`, and a model it runs gets one `Experts` (`experts_of(model)`), whose two
seats say who computes:

- `target(layer, module, hidden, top_k_index, top_k_weights)`: the target's experts. By
  default the function the model used before (Hugging Face's own); the offload runtime
  (offload/runtime.py), a store streamed layer by layer (offload/streamed.py) or resident's
  fixed-shape step (decoding/compiled_decode.py) take the seat;
- `draft`: a `DraftMode` (decoding/draft_mode.py: the INT4 layers and their listeners) or
  None.

`mode` says which seat computes now: "target", or "draft" inside `with experts.drafting():`
(the draft's layers then compute: `DraftMode.forward`). The switch is the dispatcher's own,
so a window's draft steps go from the loop to the draft's layers through this file alone.

The seats are independent: attaching the runtime and the draft in either order dispatches
alike. `runtime` names the offload runtime in the target seat, for code that hands it
routing directly (decoding/verify_pieces.py).
"""

from __future__ import annotations

import contextlib

from torch import nn

from specter.models.introspect import experts_modules

IMPL_NAME = "specter"


def dispatch(module: nn.Module, hidden_states, top_k_index, top_k_weights):
    """The registered experts function: the draft's layer in draft mode, else the target."""
    experts: Experts = module._specter_experts
    layer = module._specter_layer
    if experts.mode == "draft":
        return experts.draft.forward(layer, hidden_states, top_k_index, top_k_weights)
    return experts.target(layer, module, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPL_NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, dispatch)


def _model_function(model: nn.Module, module: nn.Module):
    """The experts function the model ran before Specter's dispatcher (HF's own loop unless
    its config named another registered implementation)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = getattr(model.config, "_experts_implementation", None) or "eager"
    eager = type(module).forward.__wrapped__  # HF's own loop, under use_experts_implementation
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, eager) if name != "eager" else eager


class Experts:
    """A model's routed experts as Specter dispatches them (module docstring)."""

    def __init__(self, model: nn.Module):
        _register()
        self.modules = [m for _, m in experts_modules(model)]
        before = _model_function(model, self.modules[0])

        def as_the_model_ran(layer, module, hidden_states, top_k_index, top_k_weights):
            return before(module, hidden_states, top_k_index, top_k_weights)

        self.target = as_the_model_ran
        self.draft = None  # a DraftMode
        self.mode = "target"  # or "draft": the draft's layers compute (`drafting`)
        self.runtime = None  # the offload runtime, when it holds the target seat
        for l, m in enumerate(self.modules):
            m._specter_experts, m._specter_layer = self, l
        model.config._experts_implementation = IMPL_NAME

    @contextlib.contextmanager
    def drafting(self):
        """The draft's layers compute inside the block (its mode restored after); yields the
        `DraftMode`."""
        if self.draft is None:
            raise RuntimeError("no draft is attached to this model's experts")
        previous, self.mode = self.mode, "draft"
        try:
            yield self.draft
        finally:
            self.mode = previous


def experts_of(model: nn.Module) -> Experts:
    """The model's `Experts`, attached at the first call."""
    mods = experts_modules(model)
    found = getattr(mods[0][1], "_specter_experts", None) if mods else None
    if found is None:
        found = Experts(model)
    return found
