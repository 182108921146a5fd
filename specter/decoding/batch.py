"""The one engine protocol every system answers, and the batch's KV cache they share.

Owns: `Engine` (reset before a request, outside timing; generate a request), `Generation`
(committed tokens with their commit times and the system's own statistics), `BatchCache` (B
sequences in one rectangular KV cache), `DeviceMemory` (a request's peak device bytes) and the
`Timeline` a decode loop reads time from (a link's compute-stream clock: virtual, emulated or
real).
Does not own: the decode loops (decoding/loop.py), where experts live (offloading runtime),
metrics arithmetic (metrics.py).

Systems differ in policy, not in model code: each one drives the same transformers model.
"""

from __future__ import annotations

import contextlib

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from specter.counting import host_side, to_device
from specter.metrics import Generation  # (re-exported: the loops build it)
from specter.models.introspect import forward_logits, new_cache  # (re-exported)


class Engine(Protocol):
    """What every system answers. `generate(prompt_ids, max_new_tokens, on_commit=None)`:
    `on_commit(tokens: list[int])`, when given, is called on the decoding thread each time the
    request commits new tokens, with exactly those new tokens in order: the prefill's first
    token, then each speculative window's accepted proposals plus the target's token (or one
    token per greedy step). The concatenation of its calls equals the request's
    `Generation.tokens` exactly (a final stop token included, `max_new_tokens` respected); a
    listener that returns False ends its request at that commit (a client that went away).
    None (the default): decoding, its timing and its operation counts are unchanged (one `if`
    per commit)."""

    name: str
    device: torch.device
    speculates: bool  # drafts and verifies (reads spec.*)
    samples: bool  # decodes at workload.temperature > 0 (`seed_requests` per batch)
    batches: bool  # decodes workload.batch requests together (`generate_batch`)
    compiled: dict  # a compiled step's record columns (draft_compiled, decode_compiled); {}

    def reset(self) -> None:
        """Return to the fixed initial state before a request (outside timing)."""

    def seed_requests(self, seeds: list[int]) -> None:
        """The random state of each request of the next batch (sampling engines; others
        ignore it)."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 on_commit: Callable[[list[int]], None] | None = None) -> Generation:
        """One request; `on_commit` hears its tokens as they are committed (above)."""

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                       on_commit: list | None = None) -> list[Generation]:
        """Several requests decoded together (one per row), each as `generate` would:
        `max_new_tokens` one limit or one per request, `on_commit` one listener or None per
        request."""


def cache_bytes(cache) -> int:
    """Bytes held by the tensors of a `DynamicCache`, measured from the tensors themselves."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


class Timeline(Protocol):
    """What a decode loop reads time from (the link: offload/link.py, whose compute timeline
    the clock advances; "clock" names the charging side, clock/). It takes marks on the
    compute timeline as it goes (no device wait) and reads them as seconds once the request
    is over."""
    kind: str

    def mark(self): ...

    def elapsed(self, start, end, wait: bool = False) -> float | None: ...

    def timestamp(self, mark) -> float: ...


def pad_id(model) -> int:
    """The token id of padding positions (their values never reach a real token: masked)."""
    gc = model.generation_config
    if gc.pad_token_id is not None:
        return int(gc.pad_token_id)
    eos = sorted(eos_ids(model))
    return eos[0] if eos else 0


class BatchCache:
    """A rectangular KV cache of B sequences, each with its own real positions.

    Rows are fed blocks of unequal length, right-aligned (left padding, as `generate` pads a
    batch): the columns a row did not fill, and speculative positions a row rejected
    (`keep`), are holes. Holes are masked out of attention, and each real token's position id
    counts only its row's real tokens before it, so every row computes what it would alone.
    While there is no hole the model is called exactly as for one sequence (no mask, no
    position ids). `select` drops finished rows; `crop` and `keep` shorten every row.
    Who hears of a forward is the caller's business (decoding/loop.py `Events`): `shape`
    gives what they hear."""

    def __init__(self, model, device: torch.device, rows: int):
        self.model, self.device = model, device
        self.cache = new_cache(model)
        self.mask = torch.ones(rows, 0, dtype=torch.bool)  # [B, columns]: real positions
        self.valid = [0] * rows  # real tokens per row (the next token's position id)
        self.pad = pad_id(model)

    @property
    def rows(self) -> int:
        return len(self.valid)

    @property
    def length(self) -> int:
        """Columns of the cache (what attention reads, holes included)."""
        return self.mask.shape[1]

    def shape(self, blocks: list[list[int]]) -> tuple[int, int, int]:
        """What a forward of `blocks` computes: (tokens a row, padding included; context each
        token attends over, holes included; rows)."""
        width = max(len(b) for b in blocks)
        return width, self.length + width, len(blocks)

    def forward(self, blocks: list[list[int]], live: list[bool] | None = None,
                logits_to_keep: int = 1, device_ids: torch.Tensor | None = None,
                pieces=None) -> torch.Tensor:
        """One forward of `blocks[b]` appended to row b (`live[b]` False: the row's block is all
        holes, computed but never kept); returns logits [B, logits_to_keep, V] of the block's
        last positions. `device_ids` [B, width]: the blocks' token ids already on the device
        (the draft's own last choice, never read to the host); `blocks` then only give each
        row's length. `pieces`: None (transformers' forward), or what makes the block inside
        which the forward runs in verification's pieces (decoding/verify_pieces.py `pieces`
        over a runner)."""
        rows, width = len(blocks), max(len(b) for b in blocks)  # (a block for every row)
        with host_side():  # built on the host, copied over below
            ids = torch.full((rows, width), self.pad, dtype=torch.long)
            real = torch.zeros(rows, width, dtype=torch.bool)
            pos = torch.zeros(rows, width, dtype=torch.long)
            for r, block in enumerate(blocks):
                n, at = len(block), width - len(block)
                if device_ids is None:
                    ids[r, at:] = torch.tensor(block, dtype=torch.long)
                pos[r] = self.valid[r]
                if live is None or live[r]:
                    real[r, at:] = True
                    pos[r, at:] = torch.arange(self.valid[r], self.valid[r] + n)
                    self.valid[r] += n
            self.mask = torch.cat([self.mask, real], dim=1)
            holes = not bool(self.mask.all())
        kwargs = {}
        if holes:  # (uploads from pinned memory: no host wait, counting.to_device)
            with host_side():
                mask = self.mask.long()
            kwargs = {"attention_mask": to_device(mask, self.device),
                      "position_ids": to_device(pos, self.device)}
        ids = to_device(ids, self.device) if device_ids is None else device_ids
        with contextlib.nullcontext() if pieces is None else pieces():
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True,
                             logits_to_keep=logits_to_keep, **kwargs)
        return out.logits

    def copy_for(self, model) -> "BatchCache":
        """A copy of this cache (every layer's K and V) that `model` continues."""
        twin = BatchCache(model, self.device, 0)
        twin.cache = copy.deepcopy(self.cache)
        twin.mask, twin.valid, twin.pad = self.mask.clone(), list(self.valid), self.pad
        return twin

    def keep(self, lengths: list[int] | None = None) -> None:
        """Row r keeps its first `lengths[r]` real positions, later ones becoming holes (None:
        every row keeps what it has); then the trailing columns that are holes in every row
        go."""
        with host_side():
            for r, n in enumerate(lengths or ()):
                real = self.mask[r].nonzero().flatten()
                if len(real) > n:
                    self.mask[r, real[n:]] = False
                self.valid[r] = min(self.valid[r], n)
            filled = self.mask.any(dim=0).nonzero()
            end = int(filled[-1]) + 1 if len(filled) else 0
        self.crop(end)

    def crop(self, length: int) -> None:
        """Keep the first `length` columns of every row."""
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count: columns removed
            with host_side():
                self.mask = self.mask[:, :length]
                self.valid = self.mask.sum(dim=1).tolist()

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the current rows), in that order."""
        if rows == list(range(self.rows)):
            return
        self.cache.batch_select_indices(torch.tensor(rows, device=self.device))
        with host_side():
            self.mask = self.mask[rows]
        self.valid = [self.valid[r] for r in rows]
        self.keep()  # (columns only the dropped rows filled)


class DeviceMemory:
    """Peak device memory of one request: the CUDA allocator's peak when on CUDA; on CPU the
    measured bytes of the model's parameters plus the largest KV cache seen. The loops show it
    the cache where it is largest: after each forward that grows it (a speculative window's
    verification, before the rejected positions become holes), with the KV a draft holds of
    its own."""

    def __init__(self, model, device: torch.device, extra_bytes: int = 0):
        self.cuda = device.type == "cuda"
        # Parameters on the device, plus buffers the caller holds there (expert slots).
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                               if p.device.type == device.type) + extra_bytes
        self.peak_kv = 0

    def start(self) -> None:
        self.peak_kv = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def observe_cache(self, cache, held: int = 0) -> None:
        """The KV cache's bytes now, plus `held` bytes of other KV buffers (a static draft's)."""
        if not self.cuda:
            self.peak_kv = max(self.peak_kv, cache_bytes(cache) + held)

    def peak(self) -> tuple[int, str]:
        if self.cuda:
            return torch.cuda.max_memory_allocated(), "cuda_allocator"
        return self.param_bytes + self.peak_kv, "device_tensors"
