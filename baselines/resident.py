"""`system=resident`: every expert on the device, plain greedy decoding.

The no-offload limit every other system is compared to, and the reference for losslessness:
its tokens must equal Hugging Face `generate` of the same model token for token. The experts
stay Hugging Face's own; under the virtual clock each step is charged by the cost model.
`system.compile` (batch 1; `auto` on a real clock, the CPU's or a GPU's): each decode step one
compiled graph over a static cache (specter/decoding/compiled_decode.py), the fair baseline of a
compiled draft step; on CUDA the whole step is captured as one CUDA graph and replayed, as the
draft's step is (the same `capture_graph`), in the runner's untimed warm-up request.
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.config import COMPILE_MODES, SystemConfig
from specter.decoding.engines import GreedyEngine, build_greedy

ENGINE = GreedyEngine
CAPTURED_DECODE = "the whole decode step captured as one CUDA graph, replayed per step"
OFFLOADS = False  # every expert on the device: any clock, CPU included


@dataclass
class Config(SystemConfig):
    compile: str = "auto"  # on | off | auto (CPU, real clock): the decode step compiled
    compile_backend: str = "inductor"  # torch.compile's backend ("eager": graph check only)

    def validate(self) -> None:
        if self.compile not in COMPILE_MODES:
            from specter.errors import UserError

            raise UserError(f"system.compile must be one of {', '.join(COMPILE_MODES)} "
                            f"(got '{self.compile}').")


def build(job) -> GreedyEngine:
    return build_greedy(job, "resident", offload=False,
                        static=lambda timing, clock: decode_step(job, timing, clock))


def decode_step(job, timing, clock):
    """`system.compile`, decided with the engine's clock: (a `CompiledDecode` charged through the
    engine's `clock` as a captured graph on a virtual clock, or None; its record columns)."""
    from specter.decoding.compiled_decode import CompiledDecode, resolve_system_compile

    sc = job.system
    on, why = resolve_system_compile(sc.compile, job.rows, timing.kind, job.temperature > 0)
    cuda = job.device.type == "cuda"
    static = None
    if on:
        from specter.quant.kernels import capture_graph

        static = CompiledDecode(job.loaded.model, sc.compile_backend, positions=job.positions + 1,
                              capture=capture_graph if cuda else None,
                              clock=clock)
    if on and cuda:
        why = f"{why}: {CAPTURED_DECODE}"
    return static, {"decode_compiled": on, "decode_compile": why,  # captured: a CUDA graph
                    "decode_captured": on and (cuda or timing.kind.charged)}  # or charged as one
