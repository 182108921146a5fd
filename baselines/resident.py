"""`system=resident`: every expert on the device, plain greedy decoding.

The no-offload limit every other system is compared to, and the reference for losslessness:
its tokens must equal Hugging Face `generate` of the same model token for token. The experts
stay Hugging Face's own; under the virtual clock each step is charged by the cost model.
"""

from __future__ import annotations

from specter.decoding.engines import GreedyEngine, build_greedy

ENGINE = GreedyEngine
OFFLOADS = False  # every expert on the device: any clock, CPU included


def build(ctx) -> GreedyEngine:
    return build_greedy(ctx, "resident", offload=False)
