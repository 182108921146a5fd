"""`system=resident`: every expert on the device, plain greedy decoding.

The no-offload limit every other system is compared to, and the reference for losslessness:
its tokens must equal Hugging Face `generate` of the same model token for token. The experts
stay Hugging Face's own; under the virtual clock each step is charged by the cost model.
`system.compile` (batch 1; `auto` on a real clock on the CPU, where it was measured faster; `on`
CUDA too): each decode step one compiled graph over a static cache
(specter/decoding/static_decode.py), the fair baseline of a compiled draft step.
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.config import SystemConfig
from specter.decoding.engines import GreedyEngine, build_greedy

ENGINE = GreedyEngine
OFFLOADS = False  # every expert on the device: any clock, CPU included


@dataclass
class Config(SystemConfig):
    compile: str = "auto"  # on | off | auto (CPU, real clock): the decode step compiled
    compile_backend: str = "inductor"  # torch.compile's backend ("eager": graph check only)

    def validate(self) -> None:
        from specter.decoding.static_decode import MODES

        if self.compile not in MODES:
            from specter.errors import UserError

            raise UserError(f"system.compile must be one of {', '.join(MODES)} "
                            f"(got '{self.compile}').")


def build(ctx) -> GreedyEngine:
    from specter.decoding.static_decode import StaticDecode, resolve_system_compile

    engine = build_greedy(ctx, "resident", offload=False)
    sc, w = ctx.cfg.system, ctx.cfg.workload
    on, why = resolve_system_compile(sc.compile, w.batch, engine.timing.clock,
                                     ctx.device.type)
    if on:
        mode = "reduce-overhead" if ctx.device.type == "cuda" else None
        engine.static = StaticDecode(ctx.loaded.model, sc.compile_backend, mode,
                                     positions=w.prompt_tokens + w.max_new_tokens + 1)
        if hasattr(engine.charger, "captured_step"):  # a virtual clock: charged as captured
            engine.static.charger = engine.charger
    engine.compiled = {"decode_compiled": on, "decode_compile": why,  # captured: CUDA graphs
                       "decode_captured": on and (ctx.device.type == "cuda"  # or charged so
                                                  or engine.timing.clock == "virtual")}
    return engine
