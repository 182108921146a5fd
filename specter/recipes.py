"""What each system's recipe declares, read once: how to build its engine and what the
composition root must know before it does.

A system is one module exposing `build(job) -> Engine` (`job`: specs.py `Job`) and `ENGINE`
(the engine class it builds: `specter.decoding.engines`' GreedyEngine or SpeculativeEngine for
every decoding system), named in one line of the registry (specter/registry.py `SYSTEMS`).
Recipes import their optional dependencies inside `build`. The composition root
(specter/compose.py) reads them here; each system's `Config` is read with the settings
(specter/config.py `system_config_class`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from specter.budget import Footprint
from specter.config import RunConfig, SystemConfig, system_config_class
from specter.decoding.batch import Engine
from specter.errors import UserError
from specter.registry import SYSTEMS, recipe_module
from specter.specs import Job

__all__ = ["SYSTEMS", "Recipe", "recipe", "build_engine", "check_system", "depth_of",
           "footprint", "sampling_systems"]


@dataclass(frozen=True)
class Recipe:
    """What a system's module declares, read once (`recipe`): how to build its engine and
    what the composition root must know before it does."""

    name: str
    build: Callable[[Job], Engine]  # build(job) -> its engine
    engine: type  # ENGINE: the engine class it builds (GreedyEngine, SpeculativeEngine, ...)
    config: type[SystemConfig]  # Config: its knobs (default: none)
    offloads: bool  # OFFLOADS: copies experts while decoding (default True)
    loads_experts: str  # LOADS_EXPERTS: where the loader puts the routed experts ("host")
    own_k: tuple[int, str] | None  # OWN_K: a depth of its own (decoding/depth.py)
    footprint: Callable[[SystemConfig], Footprint]  # footprint(config) or FOOTPRINT

    @property
    def speculates(self) -> bool:
        """Drafts and verifies (reads spec.*; speculative sampling above temperature 0)."""
        return self.engine.speculates

    @property
    def samples(self) -> bool:
        """Decodes at workload.temperature > 0 (speculative sampling, or plain sampling as
        `generate(do_sample=True)` draws)."""
        return self.engine.samples

    @property
    def batches(self) -> bool:
        return self.engine.batches


@functools.cache
def recipe(name: str) -> Recipe:
    """System `name`'s recipe: its module's declarations (module docstring), with their
    defaults, read here only."""
    module = recipe_module(name)
    declared = vars(module)
    fixed = declared.get("FOOTPRINT", Footprint())
    return Recipe(name=name, build=module.build, engine=module.ENGINE,
                  config=system_config_class(name),
                  offloads=declared.get("OFFLOADS", True),
                  loads_experts=declared.get("LOADS_EXPERTS", "host"),
                  own_k=declared.get("OWN_K"),
                  footprint=declared.get("footprint", lambda system: fixed))


def sampling_systems() -> tuple[str, ...]:
    """Systems whose engine decodes at workload.temperature > 0 (`Engine.samples`, read off
    each recipe's ENGINE); the others decode greedily only."""
    return tuple(n for n in SYSTEMS if recipe(n).samples)


def footprint(system: SystemConfig) -> Footprint:
    """What `system` keeps on the device besides resident expert slots (budget.gb resolves
    the slots from what is left): its recipe's `footprint(config)` or `FOOTPRINT`, else
    nothing (the INT4 draft for the systems that draft on the device, a second instance for
    SpecMoEOff and Specter without sharing, whole layers for accelerate)."""
    return recipe(system.name).footprint(system)


def check_system(system: SystemConfig, temperature: float = 0.0) -> None:
    name = system.name
    if name not in SYSTEMS:
        raise UserError(f"unknown system '{name}'; choose one of: {', '.join(sorted(SYSTEMS))}.")
    if temperature > 0 and not recipe(name).samples:
        raise UserError(f"workload.temperature > 0 needs a system that samples "
                        f"({', '.join(sampling_systems())}); system={name} decodes greedily only.")


def build_engine(job: Job) -> Engine:
    """The system's engine for `job` (specs.py; under spec.k=auto, at the base K until the
    harness's depth profiler gives it the profiled one: experiments/depth_profile.py)."""
    check_system(job.system, job.temperature)
    return recipe(job.system.name).build(job)


def depth_of(cfg: RunConfig):
    """The `Depth` a speculative system's engine will be built with (decoding/depth.py); None
    for a greedy one."""
    from specter.decoding.depth import settle_depth

    r = recipe(cfg.system.name)
    return settle_depth(cfg.spec, cfg.model.paper_k, r.own_k) if r.speculates else None

