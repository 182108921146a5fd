"""`system=host_experts`: every routed expert computed on the host CPU from host memory, none
ever copied to the device: the design of llama.cpp's `--n-cpu-moe` / `-ot exps=CPU`,
kTransformers and Fiddler's decode.

The non-expert weights (attention, norms, routers, shared experts, the lm head) and the KV
cache stay on the device. Per MoE layer the tokens' activations go down the link once, the
host computes each expert the router chose and sums their weighted products in expert-id
order, and the sum comes back once (offload/host.py `HostPath.layer_sum`). The device holds no
expert slots under any budget. Greedy; a CPU run's host computes in the model's dtype, so its
tokens equal `resident`'s. On the virtual clock the host's time is the hardware profile's host
rates (conf/host/: memory-bound at batch 1, FLOP-bound as tokens grow), the activations' trips
the link's; on a real clock the host thread runs the jobs as the hybrid path's.

`system=host_experts_s` (baselines/host_experts_s.py) drafts K tokens with the INT4 self-draft
on the device and verifies them with the experts on the host.
"""

from __future__ import annotations

from specter.budget import Footprint
from specter.decoding.engines import GreedyEngine, build_greedy

ENGINE = GreedyEngine
FOOTPRINT = Footprint(host_experts=True)  # no expert slots: the device budget is the rest


def build(job) -> GreedyEngine:
    return build_greedy(job, "host_experts", host_all=True)
