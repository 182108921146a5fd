"""Pinned host memory as torch reserves it, and the plan the host expert store is made by.

Owns: what torch's caching host allocator reserves for one pinned request
(`pinned_reserved_bytes`), the pinned-allocator settings read from the environment, and the
store's plan (`plan_store`): which power-of-two chunks hold which experts. The store
allocates by this plan (store.py) and the preflight counts by it (placement/bytes.py):
one source of truth.
Does not own: the tensors (store.py), the refusal sentences (placement/bytes.py).

The rule. `CachingHostAllocatorImpl::allocate` in torch's
`include/ATen/core/CachingHostAllocator.h` (lines 295-308 in torch 2.13) rounds a request up
to the next power of two (`c10::llvm::PowerOf2Ceil(size)`) when
`size <= pinned_max_round_threshold()` and `size <= pinned_max_cached_size()`, then allocates
the rounded size (`allocate_host_memory(roundSize, ...)`). Both limits default to
`std::numeric_limits<size_t>::max()` (`c10/core/AllocatorConfig.h`): every request is
rounded. They are set in MiB by `pinned_max_round_threshold_mb` and
`pinned_max_cached_size_mb` in `PYTORCH_ALLOC_CONF` (or, read when that is unset,
`PYTORCH_CUDA_ALLOC_CONF`). The rounding happens before the CUDA backend pins, so it applies
whether torch pins with cudaHostAlloc or, under `pinned_use_cuda_host_register:True`
(`c10/cuda/CUDAAllocatorConfig.h`), with malloc + cudaHostRegister. (CUDA's
`pinned_reserve_segment_size_mb`, default 0, pins one segment of that size up front to carve
small requests from; it is the user's setting and not counted here.)
tests/test_pinned.py reads the installed headers so a torch that changes the rule fails.

Why power-of-two chunks. One pinned tensor per expert made DeepSeek-V2-Lite's 16.5 MiB
experts take 32 MiB each: 52 GiB pinned for 26.8 GiB of experts. One tensor per layer does
not help (64 x 16.5 MiB = 1056 MiB, rounded to 2048 MiB). Of the ways out:
- pinning pageable memory ourselves (`cudaHostRegister` through `torch.cuda.cudart()`) gives
  tensors torch's allocator does not know: no stream events recorded for them, an unregister
  we must pair with every free ourselves, nothing to test without a GPU;
- setting the round threshold is process-wide (every pinned buffer loses the reuse the
  rounding is for), must be in the environment before torch's allocator reads it, and
  torch versions before the key existed refuse it;
- chunks whose sizes are already powers of two are rounded to themselves, by any torch that
  rounds this way and by one that does not round at all. They are plain `pin_memory=True`
  tensors (stream events, `is_pinned`, freeing: all torch's), and the plan is pure
  arithmetic, tested on the CPU.
So the store packs its experts, layer after layer, into power-of-two chunks, each expert one
contiguous slot inside one chunk (one copy of it is still one DMA), the slot stride rounded
up to `SLOT_ALIGN` bytes; of the ways to do so with chunks up to `max_chunk`, the plan takes
the one of fewest bytes (`plan_store`): never more than one tensor per expert took, and
0.1-2% over the experts' bytes for real models (tests/test_pinned.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol

NO_LIMIT = 2**64 - 1  # size_t's max: the allocator's default for both limits
MiB = 2**20
SLOT_ALIGN = 512  # bytes between expert slots' starts are a multiple of this
MAX_CHUNK = 4 * 2**30  # the largest chunk, unless one expert is large (`max_chunk`)
FULL_SLOTS = 16  # a chunk of the largest size holds at least this many experts


def pow2_ceil(n: int) -> int:
    """c10::llvm::PowerOf2Ceil: the smallest power of two >= n (0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def pinned_reserved_bytes(request_bytes: int, round_threshold: int = NO_LIMIT,
                          max_cached: int = NO_LIMIT) -> int:
    """The bytes torch's caching host allocator reserves for one pinned request of
    `request_bytes` (CachingHostAllocatorImpl::allocate, ATen/core/CachingHostAllocator.h):
    the next power of two unless the request is above either limit."""
    if request_bytes <= 0:
        return 0
    if request_bytes <= round_threshold and request_bytes <= max_cached:
        return pow2_ceil(request_bytes)
    return request_bytes


def _conf_mib(conf: str, key: str) -> int | None:
    for item in conf.replace(" ", "").split(","):
        name, _, value = item.partition(":")
        if name == key and value.isdigit():
            return int(value) * MiB
    return None


def allocator_limits(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(round threshold, max cached size) in bytes from the allocator settings in `env`
    (the process's environment by default): `pinned_max_round_threshold_mb` and
    `pinned_max_cached_size_mb` of PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF."""
    env = os.environ if env is None else env
    conf = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    threshold = _conf_mib(conf, "pinned_max_round_threshold_mb")
    cached = _conf_mib(conf, "pinned_max_cached_size_mb")
    return (NO_LIMIT if threshold is None else threshold, NO_LIMIT if cached is None else cached)


@dataclass(frozen=True)
class Chunk:
    nbytes: int  # one allocation: a power of two, which the allocator reserves as it is
    slots: int  # the experts it holds, `slot_bytes` apart from its start


@dataclass(frozen=True)
class StorePlan:
    """Every expert of a store (MoE layer after layer, expert after expert) in its chunk."""

    expert_bytes: int
    slot_bytes: int
    chunks: tuple[Chunk, ...]

    @property
    def experts(self) -> int:
        return sum(c.slots for c in self.chunks)

    @property
    def request_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def reserved_bytes(self, pinned: bool = True, limits: tuple[int, int] | None = None) -> int:
        """What the store's allocations take: as the pinned allocator reserves them
        (`limits`: (round threshold, max cached), the environment's when None), or as
        requested when pageable (the CPU allocator does not round)."""
        if not pinned:
            return self.request_bytes
        threshold, cached = allocator_limits() if limits is None else limits
        return sum(pinned_reserved_bytes(c.nbytes, threshold, cached) for c in self.chunks)

    def places(self) -> Iterator[tuple[int, int]]:
        """(chunk index, byte offset) of every expert, in the store's order."""
        for i, c in enumerate(self.chunks):
            for s in range(c.slots):
                yield i, s * self.slot_bytes


def max_chunk(slot_bytes: int) -> int:
    """The largest chunk a plan may use: `MAX_CHUNK`, or for experts so large that it would
    hold few of them, the power of two holding `FULL_SLOTS` (a full chunk then wastes less
    than 1/FULL_SLOTS of itself)."""
    return max(MAX_CHUNK, pow2_ceil(FULL_SLOTS * slot_bytes))


def plan_store(expert_bytes: int, experts: int, align: int = SLOT_ALIGN) -> StorePlan:
    """The chunks holding `experts` experts of `expert_bytes` bytes each: of every multiset
    of power-of-two sizes (from one slot's up to `max_chunk`) that holds them, the one of
    fewest bytes, then of fewest chunks (a small dynamic programme over the expert count),
    largest chunk first."""
    if expert_bytes <= 0 or experts < 0:
        raise ValueError(f"a store plan needs experts of positive size (got {expert_bytes} "
                         f"bytes x {experts})")
    slot = -(-expert_bytes // align) * align
    sizes, size = [], pow2_ceil(slot)
    while size <= max(pow2_ceil(slot), min(max_chunk(slot), pow2_ceil(experts * slot))):
        sizes.append(size)
        size *= 2
    # cost[r]: (bytes, chunks) of the best plan for r experts; pick[r]: its first chunk
    cost: list[tuple[int, int]] = [(0, 0)]
    pick: list[int] = [0]
    for r in range(1, experts + 1):
        best, choice = None, 0
        for size in sizes:
            before = cost[max(0, r - size // slot)]
            c = (before[0] + size, before[1] + 1)
            if best is None or c < best:
                best, choice = c, size
        cost.append(best)
        pick.append(choice)
    chunks, rest = [], experts
    while rest:
        size = pick[rest]
        chunks.append(Chunk(size, min(rest, size // slot)))
        rest -= chunks[-1].slots
    chunks.sort(key=lambda c: (-c.nbytes, -c.slots))
    return StorePlan(expert_bytes, slot, tuple(chunks))


class _Layout(Protocol):  # store.ExpertLayout
    num_experts: int

    @property
    def nbytes(self) -> int: ...


def store_plan(layout: _Layout, n_layers: int) -> StorePlan:
    """The plan of a store of `n_layers` MoE layers of `layout`'s experts."""
    return plan_store(layout.nbytes, n_layers * layout.num_experts)


def store_pinned_bytes(layout: _Layout, n_layers: int,
                       limits: tuple[int, int] | None = None) -> int:
    """What the pinned allocator reserves for that store (its chunks)."""
    return store_plan(layout, n_layers).reserved_bytes(True, limits)


def per_expert_pinned_bytes(layout: _Layout, n_layers: int,
                            limits: tuple[int, int] | None = None) -> int:
    """What it reserved when each expert was its own pinned tensor (the scheme before
    chunks): every expert rounded up to a power of two."""
    threshold, cached = allocator_limits() if limits is None else limits
    return n_layers * layout.num_experts * pinned_reserved_bytes(layout.nbytes, threshold, cached)
