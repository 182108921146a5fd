"""The registry of systems: each system's name -> the module (its recipe) that builds it.

A new system is one line here and one module exposing `build(job) -> Engine` and `ENGINE`
(specter/recipes.py reads the rest of what a recipe declares). The table imports nothing of
the project, so the settings (specter/config.py: each system's `Config`) and the recipes'
reader (specter/recipes.py) both read it without importing each other. Recipes are imported
by name on use (the baselines live in `baselines/`, beside this package; `fidelity` is the
harness's routing measurement).
"""

from __future__ import annotations

import importlib
from types import ModuleType

SYSTEMS: dict[str, str] = {
    "resident": "baselines.resident",
    "lru": "baselines.lru",
    "lru_hybrid": "baselines.lru",  # lru with host-computed misses (Fiddler's rule)
    "mo_sm": "baselines.mo_sm",
    "quasi_hidden": "baselines.quasi_hidden",
    "transformers": "baselines.transformers_offload",
    "vllm_offload": "baselines.vllm_offload",  # vLLM's cpu_offload_gb, modelled
    "lru_s": "baselines.lru_s",
    "specmoeoff": "baselines.specmoeoff",
    "specter": "specter.specter_recipe",
    "specter_hybrid": "specter.specter_recipe",  # specter with host-computed misses
    "sp_e": "baselines.single_plan",
    "sp_l": "baselines.single_plan",
    "specmoe": "baselines.specmoe",
    "host_experts": "baselines.host_experts",  # every routed expert on the host (llama.cpp's design)
    "host_experts_s": "baselines.host_experts_s",  # ... with the INT4 self-draft
    "last_window": "baselines.last_window",
    "fidelity": "experiments.fidelity",  # a measurement, not a decoder: draft vs target routing
}


def recipe_module(name: str) -> ModuleType:
    """System `name`'s module, imported on first use."""
    return importlib.import_module(SYSTEMS[name])
