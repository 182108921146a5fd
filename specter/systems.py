"""The registry of systems: a name -> the module (recipe) that builds its engine.

A new system is one module exposing `build(job) -> Engine` (`job`: specs.py `Job`) and
`ENGINE` (the engine class it builds: `specter.decoding.engines`' GreedyEngine or
SpeculativeEngine for every decoding system) and one line here. Recipes are imported by name on use (the baselines live in
`baselines/`, beside this package; `fidelity` is the harness's routing measurement), and
import their optional dependencies inside `build`. The composition root
(specter/compose.py) and the typed settings (specter/config.py, each system's `Config`) read it.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, fields
from typing import Callable

from specter.budget import Footprint
from specter.config import RunConfig, SystemConfig
from specter.decoding.batch import Engine
from specter.errors import UserError
from specter.specs import Job

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
    "specter": "specter.system",
    "specter_hybrid": "specter.system",  # specter with host-computed misses
    "sp_e": "baselines.single_plan",
    "sp_l": "baselines.single_plan",
    "specmoe": "baselines.specmoe",
    "host_experts": "baselines.host_experts",  # every routed expert on the host (llama.cpp's design)
    "host_experts_s": "baselines.host_experts_s",  # ... with the INT4 self-draft
    "last_window": "baselines.last_window",
    "fidelity": "experiments.fidelity",  # a measurement, not a decoder: draft vs target routing
}


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
    def samples(self) -> bool:
        """Decodes by speculative sampling when workload.temperature > 0 (and reads spec.*)."""
        return self.engine.samples

    @property
    def batches(self) -> bool:
        return self.engine.batches


@functools.cache
def recipe(name: str) -> Recipe:
    """System `name`'s recipe: its module's declarations (module docstring), with their
    defaults, read here only."""
    module = importlib.import_module(SYSTEMS[name])
    declared = vars(module)
    fixed = declared.get("FOOTPRINT", Footprint())
    return Recipe(name=name, build=module.build, engine=module.ENGINE,
                  config=declared.get("Config", SystemConfig),
                  offloads=declared.get("OFFLOADS", True),
                  loads_experts=declared.get("LOADS_EXPERTS", "host"),
                  own_k=declared.get("OWN_K"),
                  footprint=declared.get("footprint", lambda system: fixed))


def config_class(name: str) -> type[SystemConfig]:
    """System `name`'s settings: its recipe's `Config` (a SystemConfig subclass with its
    knobs), else the bare SystemConfig (no knobs)."""
    if name not in SYSTEMS:
        return SystemConfig
    return recipe(name).config


def settings_of(name: str) -> list[str]:
    return [f.name for f in fields(config_class(name)) if f.name != "name"]


def sampling_systems() -> tuple[str, ...]:
    """Systems whose engine decodes by speculative sampling when workload.temperature > 0
    (`Engine.samples`, read off each recipe's ENGINE); the others decode greedily only. They
    are also the systems that read `spec.*` (the draft depth)."""
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
        raise UserError(f"workload.temperature > 0 needs a speculating system "
                        f"({', '.join(sampling_systems())}); system={name} decodes greedily only.")


def check_setting(name: str, knob: str) -> None:
    """`system.<knob>` given for system `name`: one sentence if it has no such setting."""
    if name not in SYSTEMS or knob in settings_of(name):
        return
    owners = [s for s in SYSTEMS if knob in settings_of(s)]
    if owners:
        raise UserError(f"system.{knob} applies to {', '.join(owners)} only, not to system={name}.")
    own = settings_of(name)
    raise UserError(f"unknown setting 'system.{knob}'; system={name} has "
                    + (f"the settings {', '.join('system.' + k for k in own)}." if own
                       else "no settings."))


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
    return settle_depth(cfg.spec, cfg.model.paper_k, r.own_k) if r.samples else None

