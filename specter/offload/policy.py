"""Eviction policies: which resident expert of a layer gives up its slot.

A policy only ranks; the cache (cache.py) owns slots and never evicts a protected expert
(in use, in flight, or prefetched for the current window). A new policy is a small class
with these three methods, registered in POLICIES.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol


class EvictionPolicy(Protocol):
    def reset(self, order: Iterable[int]) -> None:
        """Start from resident experts in `order`, first = first to evict."""

    def touch(self, expert: int) -> None:
        """`expert` was used (or admitted) now."""

    def victim(self, candidates: set[int]) -> int:
        """Pick one of `candidates` (resident, unprotected) to evict."""

    def forget(self, expert: int) -> None:
        """`expert` left the cache."""


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def reset(self, order: Iterable[int]) -> None:
        self._order = OrderedDict((e, None) for e in order)

    def touch(self, expert: int) -> None:
        self._order[expert] = None
        self._order.move_to_end(expert)

    def victim(self, candidates: set[int]) -> int:
        for e in self._order:
            if e in candidates:
                return e
        raise RuntimeError("no evictable expert among the candidates")

    def forget(self, expert: int) -> None:
        self._order.pop(expert, None)


class LFU:
    """Least frequently used first (uses since the request started); ties: least recent."""

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._tick = 0

    def reset(self, order: Iterable[int]) -> None:
        self._uses, self._last, self._tick = {}, {}, 0
        for e in order:
            self._uses[e], self._last[e] = 0, self._tick
            self._tick += 1

    def touch(self, expert: int) -> None:
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._last[expert] = self._tick
        self._tick += 1

    def victim(self, candidates: set[int]) -> int:
        if not candidates:
            raise RuntimeError("no evictable expert among the candidates")
        return min(candidates, key=lambda e: (self._uses.get(e, 0), self._last.get(e, -1)))

    def forget(self, expert: int) -> None:
        self._uses.pop(expert, None)
        self._last.pop(expert, None)


# offload.policy=NAME (conf/config.yaml): the eviction policy of every offloading system.
POLICIES = {"lru": LRU, "lfu": LFU}


def policy_named(name: str):
    """The eviction policy `offload.policy` names (checked here only: the composition root
    asks before anything loads), or one sentence listing them."""
    if name not in POLICIES:
        from specter.errors import UserError

        raise UserError(f"unknown offload.policy '{name}'; choose one of: "
                        f"{', '.join(sorted(POLICIES))}.")
    return POLICIES[name]
