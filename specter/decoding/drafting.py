"""The draft's side of a speculative window: its steps, and the two cache layouts it drafts in.

Owns: `draft_steps`, a window's draft forwards one step at a time (a generator: the window loop
plans its prefetches between the steps), with the greedy choices kept on the device or picked
on the host; and where the draft's KV lives: `SharedDraft` (the target's own instance in draft
mode over the target's cache, Specter's layout: the proposals' KV is cropped after the window),
`SeparateDraft` (a second model with its own cache, SpecMoEOff's) and `CopiedKVDraft` (a second
model reading a per-window copy of the target's KV, the artifact's "SIC off").
Does not own: what the draft computes (its experts: decoding/drafts.py, decoding/self_draft.py),
acceptance, the window loop (loop.py).
"""

from __future__ import annotations

import torch

from specter.counting import host_side, to_device
from specter.engine import BatchCache, cache_bytes


def draft_steps(kv: BatchCache, feeds: list[list[int]], k_effs: list[int], pick, tell,
                stop: set[int], out: list[list[int]], on_device: bool = False):
    """Up to `k_effs[r]` proposals for each row r of `kv` into `out[r]`, one draft forward per
    step: row r feeds `feeds[r]` first (its tokens the draft has not seen, ending with the
    pending one), then its last proposal; a row that has drafted a stop token or its quota feeds
    its last token as a hole. `pick(r, logits_row)` chooses row r's token. Yields `(i, k_eff)`
    after each step i (1-based; k_eff is the window's last step, early once no row drafts).

    `on_device` (greedy): each step's choice (the argmax) stays on the device and is the next
    step's input; the window's proposals are read once, after its last step, and each row's
    are cut after its first stop token. A row so drafts its whole quota even past a stop token
    (those steps' KV is discarded with the window's, their tokens never proposed): the draft
    step waits for the host only at the window's end."""
    if on_device:
        yield from _draft_steps_on_device(kv, feeds, k_effs, tell, stop, out)
        return
    drafting = [k > 0 for k in k_effs]
    k_max = max(k_effs)
    for i in range(k_max):
        blocks = [f if d else f[-1:] for f, d in zip(feeds, drafting)]
        width = max(len(b) for b in blocks)
        tell(width, kv.length + width, "draft", rows=kv.rows)
        logits = kv.forward(blocks, live=drafting)
        for r in range(len(feeds)):
            if drafting[r]:
                tok = pick(r, logits[r, -1])
                out[r].append(tok)
                feeds[r] = [tok]
                drafting[r] = tok not in stop and len(out[r]) < k_effs[r]
        last = not any(drafting)
        yield i + 1, (i + 1 if last else k_max)  # a window ends early once no row drafts
        if last:
            break


def _draft_steps_on_device(kv: BatchCache, feeds: list[list[int]], k_effs: list[int], tell,
                           stop: set[int], out: list[list[int]]):
    """`draft_steps` with the greedy choices kept on the device (see there)."""
    drafting = [k > 0 for k in k_effs]
    drafted = [0] * len(feeds)
    chosen: list[torch.Tensor] = []  # per step, every row's argmax [B] (on the device)
    k_max = max(k_effs)
    # Each row's next input: its last proposal, or (a row that no longer drafts: a hole) the
    # last token it fed, as the host path feeds it.
    with host_side():
        feed = torch.tensor([f[-1] for f in feeds])
    feed = to_device(feed, kv.device)
    for i in range(k_max):
        blocks = [f if d else f[-1:] for f, d in zip(feeds, drafting)] if i == 0 \
            else [[0]] * len(feeds)
        width = max(len(b) for b in blocks)
        tell(width, kv.length + width, "draft", rows=kv.rows)
        logits = kv.forward(blocks, live=drafting, device_ids=None if i == 0 else feed[:, None])
        tok = logits[:, -1].argmax(dim=-1)
        chosen.append(tok)
        if not all(drafting):
            with host_side():
                live = torch.tensor(drafting)
            feed = torch.where(to_device(live, kv.device), tok, feed)
        else:
            feed = tok
        for r in range(len(feeds)):
            if drafting[r]:
                drafted[r] += 1
                drafting[r] = drafted[r] < k_effs[r]
        last = not any(drafting)
        yield i + 1, (i + 1 if last else k_max)
        if last:
            break
    table = torch.stack(chosen, dim=1).tolist()  # the window's one read of its proposals
    for r in range(len(feeds)):
        row = table[r][:drafted[r]]
        cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
        out[r].extend(row[:cut])


class SharedDraft:
    """The target's own instance (`shared`, a `SelfDraft`) drafts over the target's cache with
    its draft mode switched in; the proposals' KV is cropped once the window has drafted."""

    def __init__(self, shared):
        self.shared = shared

    def start(self, rows: int, device) -> None:
        """After the prefill (the target's cache is the draft's: nothing to make)."""

    def held_bytes(self) -> int:
        """No KV of its own: the target's cache is counted as the target's."""
        return 0

    def steps(self, kv: BatchCache, seqs: list[list[int]], k_effs: list[int], pick, tell,
              stop: set[int], out: list[list[int]], on_device: bool = False):
        """`draft_steps` for rows whose committed tokens are `seqs` (each feeds its pending
        token, the last of its sequence)."""
        base = kv.length
        with self.shared.draft():
            yield from draft_steps(kv, [seq[-1:] for seq in seqs], k_effs, pick, tell, stop, out,
                                   on_device)
        kv.crop(base)

    def commit(self, n_valid: list[int]) -> None:
        """After verification (nothing of the draft's own to keep)."""

    def select(self, rows: list[int]) -> None:
        """Finished rows left the target's cache, which is the draft's."""


class SeparateDraft:
    """A draft that is a second model with its own KV cache (SpecMoEOff's layout), instead of
    the shared instance's draft mode over the target's cache. Its cache keeps the draft's KV of
    committed tokens; tokens it has not seen (the target's corrections) are fed in one block
    at the start of the next window (a batch's rows right-aligned, as `BatchCache` feeds)."""

    def __init__(self, model):
        self.model = model
        self.kv: BatchCache | None = None

    def start(self, rows: int, device) -> None:
        self.kv = BatchCache(self.model, device, rows)

    def held_bytes(self) -> int:
        """Device bytes of its own KV cache (the second cache a shared instance saves)."""
        return 0 if self.kv is None else cache_bytes(self.kv.cache)

    def steps(self, kv: BatchCache, seqs: list[list[int]], k_effs: list[int], pick, tell,
              stop: set[int], out: list[list[int]], on_device: bool = False):
        """`draft_steps` in its own cache for rows whose committed tokens are `seqs` (the
        target's cache `kv` is read only by a copying draft: `sync`)."""
        self.sync(kv)
        feeds = [seq[self.kv.valid[r]:] for r, seq in enumerate(seqs)]  # unseen, then pending
        yield from draft_steps(self.kv, feeds, k_effs, pick, tell, stop, out, on_device)

    def sync(self, target: BatchCache) -> None:
        """At a window's start, before drafting (own KV: nothing to do)."""

    def commit(self, n_valid: list[int]) -> None:
        """Row r keeps the draft's KV of its first `n_valid[r]` tokens only."""
        for r, n in enumerate(n_valid):
            self.kv.keep(r, n)
        self.kv.trim()

    def select(self, rows: list[int]) -> None:
        if self.kv is not None:
            self.kv.select(rows)


class CopiedKVDraft(SeparateDraft):
    """A second model whose KV is a copy of the target's committed KV, made at the start of
    every window (the authors' artifact's "SIC off": weights apart, KV copied per window, not
    shared). The draft so reads exactly the target's KV, as the shared instance does: the
    same proposals, the same acceptance; what it costs is the copy (`on_copy(positions,
    rows, cache)` is told of each, to charge it) and the copy's memory."""

    def __init__(self, model, on_copy=None):
        super().__init__(model)
        self.on_copy = on_copy

    def sync(self, target: BatchCache) -> None:
        self.kv = target.copy_for(self.model)  # every layer's K and V, device to device
        if self.on_copy is not None:
            self.on_copy(self.kv.length, self.kv.rows, self.kv.cache)

    def commit(self, n_valid: list[int]) -> None:
        """Nothing kept: the next window copies the target's KV afresh."""
        self.kv = None
