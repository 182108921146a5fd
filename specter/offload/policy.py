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


POLICIES = {"lru": LRU}
