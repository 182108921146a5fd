"""The registry of systems the runner can execute: a name -> a function building its engine.

A new system is one module exposing `build(ctx) -> Engine` and one line here. Imports are
lazy so a system's optional dependencies load only when it is selected.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from specter.budget import ResolvedBudget
from specter.config import RunConfig
from specter.engine import Engine
from specter.errors import UserError
from specter.models.loading import LoadedModel

SYSTEMS: dict[str, str] = {
    "resident": "baselines.resident",
    "lru": "baselines.lru",
    "mo_sm": "baselines.mo_sm",
    "transformers": "baselines.transformers_offload",
    "lru_s": "baselines.lru_s",
    "specmoeoff": "baselines.specmoeoff",
    "fidelity": "experiments.fidelity",  # a measurement, not a decoder: draft vs target routing
}


@dataclass
class BuildContext:
    cfg: RunConfig
    loaded: LoadedModel
    budget: ResolvedBudget
    device: torch.device


def check_system(name: str) -> None:
    if name not in SYSTEMS:
        raise UserError(f"unknown system '{name}'; choose one of: {', '.join(sorted(SYSTEMS))}.")


def build_engine(ctx: BuildContext) -> Engine:
    check_system(ctx.cfg.system.name)
    return importlib.import_module(SYSTEMS[ctx.cfg.system.name]).build(ctx)
