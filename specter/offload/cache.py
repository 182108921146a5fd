"""Device expert cache: per MoE layer, `slots` device buffers and which expert each holds.

Owns: slot storage on the device (one flat buffer per slot, so a move is one copy), the
expert <-> slot maps, in-flight copies, protection (experts in use, in flight or prefetched
for the current window are never evicted), the fixed initial resident set that `reset`
restores before every request (outside timing), and each buffer's read fence: the point on
the compute stream after the last kernel that read it (`touch` notes a read, `end_forward`
fences a layer's reads once per forward), which a copy into that buffer waits for and
nothing else (link.py `copy(after=)`). Eviction order is the policy's (policy.py);
moving bytes is the link's (link.py).
It streams a layer's experts to its forward (`stream`): ready batches, the resident ones
first while the misses land, each batch's copies waited for with one wait; the caller's rule
(offload/runtime.py `Rounds`, `OneByOne`) picks each batch and computes it.
Does not own: deciding what to load (systems and prefetchers call `load`, `issue`).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from specter.offload.link import Link, Transfer
from specter.offload.policy import EvictionPolicy
from specter.offload.store import HostExpertStore


# A stream's batch rule: (cache, layer, experts left, experts waiting) -> (batch, waiting).
Picker = Callable[["ExpertCache", int, list[int], list[int]], tuple[list[int], list[int]]]


class LayerCache:
    def __init__(self, slots: int, numel: int, dtype: torch.dtype, device: torch.device,
                 policy: EvictionPolicy):
        self.buf = torch.empty(slots, numel, dtype=dtype, device=device)  # [S, flat]
        self.slot_of: dict[int, int] = {}
        self.expert_in: list[int | None] = [None] * slots
        self.inflight: dict[int, Transfer] = {}
        self.protected: set[int] = set()  # in use by the forward now running
        self.held: set[int] = set()  # planned for the coming verification (slot holds)
        self.staged: dict[int, int] = {}  # expert -> staging buffer (prefetched beyond the slots)
        self.policy = policy
        self.read_fence: list = [None] * slots  # per slot: after its last reader (link.fence)
        self.reading: set[int] = set()  # slots read in the forward now running, not yet fenced


class ExpertCache:
    def __init__(self, store: HostExpertStore, slots: int, device: torch.device, link: Link,
                 make_policy: Callable[[], EvictionPolicy], transfer_bytes: int | None = None,
                 staging: int = 0):
        """`staging`: expert-sized buffers shared by all layers (budget.staging) where a
        prefetch lands when no slot of its layer can take it; a staged expert serves its
        layer's next target forward and its buffer is freed right after (`release_staged`)."""
        layout = store.layout
        assert layout is not None and 0 <= slots <= layout.num_experts  # 0: host_experts
        self.store, self.slots, self.link = store, slots, link
        self.layout = layout
        # Bytes the link is charged per move (the real model's expert under charged sizes).
        self.transfer_bytes = transfer_bytes or layout.nbytes
        self.layers = [LayerCache(slots, layout.numel, layout.dtype, device, make_policy())
                       for _ in range(store.num_moe_layers)]
        self.pool = torch.empty(staging, layout.numel, dtype=layout.dtype, device=device)  # [B, flat]
        self.pool_free = list(range(staging))
        self.pool_fence: list = [None] * staging  # per staging buffer: after its last reader
        self.staged_loads = 0  # prefetches that landed in a staging buffer (since reset)

    # --- state -------------------------------------------------------------------------
    def reset(self) -> None:
        """Experts 0..slots-1 resident in every layer, LRU order by id; nothing in flight or
        protected. Direct copies, not through the link: this is outside timing."""
        for l, lc in enumerate(self.layers):
            lc.slot_of.clear()
            lc.inflight.clear()
            lc.protected.clear()
            lc.held.clear()
            lc.staged.clear()
            lc.reading.clear()
            for s in range(self.slots):
                lc.buf[s].copy_(self.store.expert(l, s))
                lc.slot_of[s] = s
                lc.expert_in[s] = s
            lc.policy.reset(range(self.slots))
        # the copies above ran on the compute stream: a copy-engine write waits for them
        fence = self.link.fence()
        for lc in self.layers:
            lc.read_fence = [fence] * self.slots
        self.pool_free = list(range(self.pool.shape[0]))
        self.pool_fence = [fence] * self.pool.shape[0]
        self.staged_loads = 0

    def resident(self, l: int, e: int) -> bool:
        """In a slot or a staging buffer (its copy may still be in flight)."""
        lc = self.layers[l]
        return e in lc.slot_of or e in lc.staged

    def ready(self, l: int, e: int) -> bool:
        """Resident with no copy outstanding."""
        lc = self.layers[l]
        return self.resident(l, e) and e not in lc.inflight

    def landed(self, l: int, e: int) -> bool:
        """Resident, its copy (if any) completed as seen now (asking never waits)."""
        t = self.layers[l].inflight.get(e)
        return self.resident(l, e) and (t is None or t.done())

    def issued(self, l: int, e: int) -> int:
        """When `e`'s outstanding copy was issued (its link's issue order; 0: none)."""
        t = self.layers[l].inflight.get(e)
        return t.seq if t is not None else 0

    def arrival(self, l: int, e: int) -> float | None:
        """When `e`'s outstanding copy lands (a virtual link's transfers know), else None."""
        t = self.layers[l].inflight.get(e)
        return getattr(t, "end", None) if t is not None else None

    def resident_set(self, l: int) -> set[int]:
        lc = self.layers[l]
        return set(lc.slot_of) | set(lc.staged)

    def protect(self, l: int, experts) -> None:
        self.layers[l].protected.update(experts)

    def unprotect(self, l: int, e: int) -> None:
        self.layers[l].protected.discard(e)

    def unprotect_all(self) -> None:
        for lc in self.layers:
            lc.protected.clear()

    def hold(self, l: int, experts) -> None:
        """Keep `experts` (planned or prefetched for the coming verification) from being
        evicted by later loads until `release_holds(l)`."""
        self.layers[l].held.update(experts)

    def held(self, l: int) -> set[int]:
        return set(self.layers[l].held)

    def release_holds(self, l: int) -> None:
        """The layer's demand is known (the target router is authoritative): plans stop
        holding slots."""
        self.layers[l].held.clear()

    def release_all_holds(self) -> None:
        for lc in self.layers:
            lc.held.clear()

    # --- a forward's demand ---------------------------------------------------------------
    def split(self, l: int, needed: list[int]) -> tuple[list[int], list[int]]:
        """Layer `l`'s `needed` experts split into hits (resident, or their copy in flight)
        and misses."""
        return ([e for e in needed if self.resident(l, e)],
                [e for e in needed if not self.resident(l, e)])

    def issue(self, l: int, experts: list[int]) -> list[int]:
        """Load `experts` in order while a slot can be freed; returns those left waiting."""
        for i, e in enumerate(experts):
            if self.load(l, e) is None:
                return experts[i:]
        return []

    def stream(self, l: int, todo: list[int], waiting: list[int], pick: Picker
               ) -> Iterator[list[int]]:
        """Layer `l`'s experts `todo` (each resident or its copy issued; `waiting`: the misses
        that found no slot yet) in ready batches: `pick(cache, l, todo, waiting) -> (batch,
        waiting)` chooses each (the caller's rule); the batch's copies are waited for with one
        wait (on the latest issued: the copy engine is FIFO) and its buffers marked read, then
        it is yielded to be computed. Once the caller has queued its compute, the batch's
        experts are released and the ones still waiting copied into the slots that frees
        (after those reads), while later batches compute."""
        while todo:
            batch, waiting = pick(self, l, todo, waiting)
            self.wait_all(l, batch)  # (landed ones: no stall, the bookkeeping only)
            for e in batch:
                self.touch(l, e)
            yield batch
            for e in batch:
                self.unprotect(l, e)
            done = set(batch)
            todo = [e for e in todo if e not in done]
            if waiting:
                waiting = self.issue(l, waiting)

    # --- moves -------------------------------------------------------------------------
    def free_slots(self, l: int) -> int:
        """Slots that could take a new expert now (empty or holding an unprotected, unheld
        expert)."""
        lc = self.layers[l]
        return sum(1 for e in lc.expert_in
                   if e is None or (e not in lc.protected and e not in lc.held))

    def load(self, l: int, e: int, avoid: set[int] = frozenset()) -> Transfer | None:
        """Make `e` resident in layer `l`, evicting by policy; returns the copy, or None when
        it was already resident or no slot can be freed (every resident expert protected).
        Unprotected experts whose copy is still in flight (a prefetch not needed after all)
        are evicted only when nothing else can be: the copy must land before its slot is
        reused, and that wait is charged to the compute stream."""
        lc = self.layers[l]
        if e in lc.slot_of:
            return None
        empty = [s for s, x in enumerate(lc.expert_in) if x is None]
        if empty:
            slot = empty[0]
        else:
            unprotected = {x for x in lc.slot_of
                           if x not in lc.protected and x not in lc.held and x not in avoid}
            landed = {x for x in unprotected if x not in lc.inflight}
            if not unprotected:
                return None
            victim = lc.policy.victim(landed or unprotected)
            self.wait(l, victim)
            slot = lc.slot_of.pop(victim)
            lc.policy.forget(victim)
            if slot in lc.reading:  # read earlier in this forward: fence its reads now
                self._fence_reads(lc)
        lc.expert_in[slot] = e
        lc.slot_of[e] = slot
        t = self.link.copy(lc.buf[slot], self.store.expert(l, e), nbytes=self.transfer_bytes,
                           after=lc.read_fence[slot])
        lc.inflight[e] = t
        lc.policy.touch(e)
        return t

    def stage(self, l: int, e: int) -> Transfer | None:
        """Copy `e` into a free staging buffer for layer `l`'s next forward; None when it is
        already resident or every buffer is taken."""
        lc = self.layers[l]
        if self.resident(l, e) or not self.pool_free:
            return None
        buf = self.pool_free.pop()
        lc.staged[e] = buf
        t = self.link.copy(self.pool[buf], self.store.expert(l, e), nbytes=self.transfer_bytes,
                           after=self.pool_fence[buf])
        lc.inflight[e] = t
        self.staged_loads += 1
        return t

    def release_staged(self, l: int) -> None:
        """Layer `l`'s target forward is done: its staged experts leave their buffers (a copy
        still in flight is waited for first: the buffer must not be overwritten under it)."""
        lc = self.layers[l]
        fence = self.link.fence() if lc.staged else None  # after the forward's reads
        for e, buf in list(lc.staged.items()):
            self.wait(l, e)
            del lc.staged[e]
            self.pool_free.append(buf)
            self.pool_fence[buf] = fence

    def end_forward(self, l: int) -> None:
        """Layer `l`'s forward has queued every kernel that reads its slots: one fence after
        them, which later copies into those slots wait for (link.py `copy(after=)`)."""
        lc = self.layers[l]
        if lc.reading:
            self._fence_reads(lc)

    def _fence_reads(self, lc: LayerCache) -> None:
        fence = self.link.fence()
        for s in lc.reading:
            lc.read_fence[s] = fence
        lc.reading.clear()

    def wait(self, l: int, e: int) -> None:
        """The compute stream waits for `e`'s copy, if one is outstanding."""
        t = self.layers[l].inflight.pop(e, None)
        if t is not None:
            self.link.wait(t)

    def wait_all(self, l: int, experts) -> None:
        """The compute stream waits for every outstanding copy of `experts` with one wait: on
        the latest issued of them (the copy engine completes copies in issue order)."""
        lc = self.layers[l]
        pending = [t for t in (lc.inflight.pop(e, None) for e in experts) if t is not None]
        if pending:
            self.link.wait(max(pending, key=lambda t: t.seq))
            for t in pending:
                t.release()

    def touch(self, l: int, e: int) -> None:
        """`e` is used (the eviction order) and its buffer about to be read by compute."""
        lc = self.layers[l]
        if e in lc.slot_of:  # staged experts are outside the eviction order (and fenced
            lc.policy.touch(e)  # when their buffer is released)
            lc.reading.add(lc.slot_of[e])

    def weights(self, l: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        lc = self.layers[l]
        if e in lc.staged:
            return self.layout.views(self.pool[lc.staged[e]])
        return self.layout.views(lc.buf[lc.slot_of[e]])

    def slot(self, l: int, e: int) -> int | None:
        """The slot of layer `l` holding `e`; None for a staged expert (or one not resident)."""
        return self.layers[l].slot_of.get(e)

    def slot_buffers(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `l`'s slots as stacked (gate_up [S, 2I, H], down [S, H, I]) views."""
        return self.layout.stacked_views(self.layers[l].buf)

    @property
    def staging(self) -> int:
        """Staging buffers in the pool (budget.staging)."""
        return self.pool.shape[0]

    def device_bytes(self) -> int:
        """Bytes of every slot and staging buffer on the device."""
        slots = sum(lc.buf.numel() * lc.buf.element_size() for lc in self.layers)
        return slots + self.pool.numel() * self.pool.element_size()
