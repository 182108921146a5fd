"""The host CPU's compute copies of routed experts, for host-computed misses.

Owns: which copy of an expert the host computes from, and converting it ahead of need. On a
CPU run the host computes in the store's own dtype from the store's own buffers (the same
arithmetic as the device: lossless). Beside a GPU the store holds fp16/bf16 and the host
computes in fp32 (CPUs lack fast half-precision kernels): a converted copy is made on the host
thread, kept most-recent-first up to `capacity` experts, so an expert the host computes again
is converted once, and one the draft's lookahead predicts and the plan could not load is
converted during the draft (`prepare`), before verification needs it.
Does not own: the decision (runtime.py `_host_side`), the host thread (link.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from specter.offload.store import HostExpertStore


class HostWeights:
    def __init__(self, store: HostExpertStore, dtype: torch.dtype, capacity: int):
        self.store, self.dtype, self.capacity = store, dtype, capacity
        self.same = dtype == store.layout.dtype  # compute from the store's buffers
        self._copies: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # the host thread converts while the decoder reads
        self._queued: set[tuple[int, int]] = set()  # conversions queued, not yet made
        self.ready_hits = 0  # host jobs whose converted copy was already there
        self.prepares = 0  # conversions queued ahead of need by the lookahead

    def get(self, l: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of expert `e` of MoE layer `l` in the host's dtype (converting now
        if no copy is kept). Runs on the host thread, inside a host job."""
        views = self.store.layout.views(self.store.flat[l][e])
        if self.same:
            return views
        with self._lock:
            w = self._copies.get((l, e))
            if w is not None:
                self._copies.move_to_end((l, e))
                self.ready_hits += 1
                return w
        w = tuple(t.to(self.dtype) for t in views)
        with self._lock:
            self._copies[(l, e)] = w
            self._queued.discard((l, e))
            while len(self._copies) > self.capacity:
                self._copies.popitem(last=False)
        return w

    def prepare(self, link, l: int, e: int, seconds: float) -> bool:
        """Queue expert `e`'s conversion on the host thread (modelled `seconds` for the host
        queue's estimate); False when there is nothing to convert."""
        with self._lock:
            if self.same or (l, e) in self._copies or (l, e) in self._queued:
                return False
            self._queued.add((l, e))
        self.prepares += 1

        def convert() -> None:
            self.get(l, e)

        link.host(convert, seconds)
        return True

    def reset_stats(self) -> None:
        self.ready_hits = self.prepares = 0
