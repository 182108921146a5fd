"""`system=lru`: autoregressive greedy decoding with experts offloaded, loaded on demand into
a per-layer LRU cache, no prefetch (the eviction policy is `offload.policy`'s).

`system=lru_hybrid` (Fiddler's rule, Kamahori et al. 2024): the same, but a miss is computed on
the host CPU from its host copy whenever that (the host's rates plus the activations' round
trip over the link, after the host's earlier jobs) ends sooner than copying the expert and
computing it on the device; a host-computed expert is not admitted to the cache.
`system.host_compute=true|false` sets it on either name.
"""

from __future__ import annotations

from dataclasses import dataclass

from specter.config import SystemConfig
from specter.decoding.engines import GreedyEngine, build_greedy

ENGINE = GreedyEngine


@dataclass
class Config(SystemConfig):
    host_compute: bool | None = None  # None: the system's default (lru: off, lru_hybrid: on)


def build(job) -> GreedyEngine:
    from specter.specter_recipe import host_compute_on

    return build_greedy(job, job.system.name, host_compute=host_compute_on(job.system))
