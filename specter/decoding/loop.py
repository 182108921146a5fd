"""The decoding loops: the speculative window loop, as the paper's figure draws it, the one
draft-step loop every draft path runs (`run_steps`: host picks, on-device picks, the compiled
and the captured step; `draft_steps` over the batch cache), the default place the draft runs
(`SharedKV`: the target's own instance in draft mode over the target's cache), and the greedy
loop (`greedy_decode_batch`: prefill, then one token a row a step), with the events they tell
(`Events`).

Owns: `speculative_batch`, one window after another: draft K tokens -> plan and issue the
prefetches -> verify -> accept -> commit. The draft proposes K tokens one forward at a time
(draft.py: the target's own instance in draft mode over the target's cache, or a second
model); between the draft's steps the window prefetcher plans and issues the copies of the
experts verification will need; the target verifies the pending token and the K proposals in
one forward of K+1 positions; each row keeps the longest prefix of proposals the target agrees
with, plus the target's token after it (`Greedy` or `Sampled`, below); the cache is then
cut to the committed tokens, so it holds exactly the target's KV for them, and the output is
the target's greedy output token for token. Batching (`Rows`), sampling (`Sampled`) and
adaptive K (`WindowDepth`) are parts the loop calls.
Does not own: where experts live (the target mode's experts implementation), what is
prefetched (the prefetcher: Specter's orchestrator, specter/pio/), the draft's arithmetic.

Invariant between windows: the cache holds the target's KV for every committed token but the
last one (the pending token), which the next window feeds first.

Time: the loop takes the timeline's marks (the link's `mark()`: a CUDA event on the compute
stream, never a device-wide wait) and turns them into seconds after the request's last token;
the host waits only to read values (each window's acceptance, the greedy picks), on the
compute stream.
`AdaptiveDepth` hears each window once the device has passed it (at once on the modelled
clocks, a window or so later on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specter.counting import host_side, to_device
from specter.decoding.batch import BatchCache, DeviceMemory, Generation, Timeline


@torch.no_grad()
def speculative_batch(model, draft, prompts: list[list[int]], max_new_tokens: int | list[int],
                      k: int,
                      device: torch.device, timeline, stop: set[int], memory,
                      events: "Events | None" = None, accept=None, depth=None,
                      on_commit: list | None = None, pieces=None) -> list[Generation]:
    """Speculative decoding of a batch of requests (B rows), window by window.
    `draft` is where and how the draft runs, over which cache (`SharedKV` below, the target's
    own instance in draft mode over its cache; draft.py's `OwnKV`, `CopiedKV`: a second model;
    compiled_draft.py's `StaticKV`: the step compiled); `events` (`Events`, below) is who hears
    the loop's events: every forward before it runs, each draft step, each window's end (the
    clock, the demand statistics, the window prefetcher); `accept` (`acceptance`: `Greedy`, the
    default, or `Sampled`) picks and accepts tokens; `depth` (an `AdaptiveDepth`) chooses each
    window's K instead of `k`; `on_commit`: per request a listener or None (`Engine.generate`'s),
    called with each commit's new tokens (`Rows._commit`; a listener that returns False ends its
    request there: it leaves the batch before the next window); None: no listener at all.
    `max_new_tokens`: one limit, or one per request. `pieces`: what makes the block verification
    runs in, in pieces (the engine's `functools.partial(verify_pieces.pieces, runner)`), or
    None (transformers' forward)."""
    _check(prompts, k)
    events = events or Events()
    accept = accept or Greedy()
    depths = None if depth is None else WindowDepth(depth, timeline)  # adaptive K
    memory.start()
    kv = BatchCache(model, device, len(prompts))
    rows = Rows(prompts, max_new_tokens, k, stop, timeline.mark(), on_commit)

    # 0. Prefill: each row's last logits give the target's first token, committed at once
    #    (as in autoregressive decoding: TTFT and TPOT mean the same for every system).
    blocks = [list(p) for p in prompts]
    events.forward("prefill", *kv.shape(blocks))
    logits = kv.forward(blocks)  # [B, 1, V]
    first = [accept.pick(b, logits[b, -1]) for b in range(len(prompts))]
    now = timeline.mark()
    memory.observe_cache(kv.cache)
    draft.start(kv)
    rows.leave(rows.commit_first(first, now), kv, draft)
    draft_pick = rows.pick(accept.draft_pick)  # the draft's choice of a cache row's token

    while rows.live:
        k_now = k if depths is None else depths.next_k()
        quotas = rows.quotas(k_now)  # [B]: at most K, and what each row still wants
        proposals: list[list[int]] = [[] for _ in rows.live]  # [B][<= K] token ids
        t_draft = timeline.mark()
        if max(quotas) > 0:
            # 1. Draft: one forward per step over every live row ...
            for step, last in draft.steps(kv, rows.live_seqs(), quotas, draft_pick,
                                          stop, proposals, events, on_device=accept.on_device):
                # 2. ... and between the steps, plan and issue the prefetches of the experts
                #    verification will need (their copies overlap the rest of the draft).
                events.draft_step(step, last)
        t_verify = timeline.mark()
        # 3. Verify: every row's pending token and its proposals in one target forward.
        blocks = [seq[-1:] + props for seq, props in zip(rows.live_seqs(), proposals)]
        width = max(len(block) for block in blocks)
        events.forward("verify", *kv.shape(blocks))
        logits = kv.forward(blocks, logits_to_keep=width, pieces=pieces)  # [B, width, V], right-aligned
        # the window's largest KV: every row's K+1 positions in, the draft's own KV still held
        memory.observe_cache(kv.cache, draft.held_bytes)
        accept.read(logits)
        now = timeline.mark()
        # 4. Accept: each row's longest agreeing prefix, then the target's own next token.
        verdicts = [accept.accept(r, b, logits, width - len(blocks[r]), proposals[r])
                    for r, b in enumerate(rows.live)]  # [B]: (kept, tokens to commit)
        # 5. Commit those tokens; the cache keeps the target's KV of committed tokens only
        #    (all but each row's new pending token); finished rows leave the batch.
        going, draft_kept = rows.commit_window(verdicts, proposals, k_now, (t_draft, t_verify, now))
        kv.keep([len(seq) - 1 for seq in rows.live_seqs()])
        if depths is not None:
            depths.observe(k_now, verdicts, proposals, (t_draft, t_verify, now))
        if max(quotas) > 0:
            draft.commit(draft_kept)
        events.window_end()
        rows.leave(going, kv, draft)
    return rows.generations(timeline, memory)


@torch.no_grad()
def greedy_decode(model, prompt_ids: list[int], max_new_tokens: int, device: torch.device,
                  timeline: Timeline, stop: set[int], memory: DeviceMemory,
                  events: "Events | None" = None, on_commit=None) -> Generation:
    """One request: `greedy_decode_batch` of one row; `on_commit(tokens)` hears each token as
    it is committed (`Engine.generate`)."""
    return greedy_decode_batch(model, [prompt_ids], max_new_tokens, device, timeline, stop, memory,
                               events,
                               on_commit=None if on_commit is None else [on_commit])[0]


@torch.no_grad()
def greedy_decode_batch(model, prompts: list[list[int]], max_new_tokens: int | list[int],
                        device: torch.device, timeline: Timeline, stop: set[int],
                        memory: DeviceMemory, events: "Events | None" = None,
                        on_commit: list | None = None,
                        draw: "Drawn | None" = None) -> list[Generation]:
    """Prefill the batch, then one token per unfinished row per step; each token's commit
    time read from `timeline`; a row that commits a stop token or its last token leaves the
    batch while the others go on. `events` (`Events`) hears of each forward before it runs
    (phase: "prefill" | "decode"). `on_commit`: per request a
    listener or None (`Engine.generate`'s), called with `[token]` as each token is committed
    (one that returns False ends its request there); None: no listener at all.
    `max_new_tokens`: one limit, or one per request. `draw` (`Drawn`): each token sampled at
    its temperature; None: the greedy token."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every request needs at least one prompt token")
    memory.start()
    events = events or Events()
    kv = BatchCache(model, device, len(prompts))
    start = timeline.mark()  # marks: read as seconds after the last token (no device wait)
    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list] = [[] for _ in prompts]
    limits = limits_of(max_new_tokens, len(prompts))
    live = list(range(len(prompts)))  # the request of each cache row
    # 1. Prefill the prompts; their last logits give the first tokens.
    blocks = [list(p) for p in prompts]
    events.forward("prefill", *kv.shape(blocks))
    logits = kv.forward(blocks)  # [B, 1, V]
    while True:
        # 2. Commit each row's token: the greedy one, or drawn.
        picked = (logits[:, -1].argmax(dim=-1).tolist() if draw is None  # host sync: next
                  else draw.tokens(logits[:, -1], live))  # step and stop check
        now = timeline.mark()
        going = []
        for r, b in enumerate(live):
            tokens[b].append(picked[r])
            times[b].append(now)
            heard = True
            if on_commit is not None and on_commit[b] is not None:
                heard = on_commit[b]([picked[r]]) is not False  # False: its request ends
            if len(tokens[b]) < limits[b] and picked[r] not in stop and heard:
                going.append(r)
        memory.observe_cache(kv.cache)
        if not going:
            break
        kv.select(going)
        live = [live[r] for r in going]
        # 3. Decode one step of every unfinished row.
        blocks = [[tokens[b][-1]] for b in live]
        events.forward("decode", *kv.shape(blocks))
        logits = kv.forward(blocks)
    peak, source = memory.peak()
    return [Generation(tokens=tokens[b], commit_times_s=[timeline.timestamp(m) for m in times[b]],
                       start_time_s=timeline.timestamp(start), peak_mem_bytes=peak,
                       peak_mem_source=source) for b in range(len(prompts))]


class Drawn:
    """Plain sampling at temperature T > 0, as `generate(do_sample=True)` draws with no other
    warper: each token from softmax(logits / T), request r drawing from `generators[r]`."""

    def __init__(self, temperature: float, generators: list[torch.Generator]):
        self.temperature, self.generators = temperature, generators

    def tokens(self, logits: torch.Tensor, requests: list[int]) -> list[int]:
        """logits [B, V] of the rows serving `requests` -> one token each."""
        p = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        return [int(torch.multinomial(p[r], 1, generator=self.generators[b]))
                for r, b in enumerate(requests)]


def limits_of(max_new_tokens: int | list[int], rows: int) -> list[int]:
    """Each request's limit: one for all, or one per request."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * rows
    if len(max_new_tokens) != rows:
        raise ValueError(f"{len(max_new_tokens)} limits for {rows} requests")
    return [int(n) for n in max_new_tokens]


def acceptance(temperature: float, generators: list[torch.Generator] | None, rows: int):
    """`Greedy` at temperature 0; `Sampled` above it, one generator per request."""
    if temperature <= 0:
        return Greedy()
    if generators is None or len(generators) != rows:
        raise ValueError("sampling needs one torch.Generator per request (seeded per request)")
    return Sampled(temperature, generators)


def _check(prompts: list[list[int]], k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be at least 1 (got {k})")
    if not prompts or any(not p for p in prompts):
        raise ValueError("every request needs at least one prompt token")


def run_steps(steps, k_effs: list[int], stop: set[int], out: list[list[int]], events):
    """The one draft-step loop, which every path runs (`steps`: host picks and on-device picks
    here, the compiled and the captured step in compiled_draft.py): before step i the events
    hear its forward (`steps.prepare(i, drafting)` readies the step and returns the forward's
    tokens, context and rows), then `steps.run(i, drafting)` runs it and returns each row's
    token (None: kept on the device). Up to `k_effs[r]` proposals for row r go into `out[r]`; a row that drafted a stop token (seen on
    the host) or its quota stops drafting. Yields `(i, k_eff)` after each step i (1-based;
    k_eff is the window's last step, early once no row drafts). Proposals kept on the device
    are read once, after the window's last step (`steps.read()`), and each row's are cut after
    its first stop token: such a row drafts its whole quota (those steps' KV is discarded with
    the window's, their tokens never proposed), so a step waits for the host only at the
    window's end."""
    drafting = [k > 0 for k in k_effs]
    drafted = [0] * len(k_effs)
    k_max = max(k_effs)
    picks = None
    for i in range(k_max):
        events.forward("draft", *steps.prepare(i, drafting))
        picks = steps.run(i, drafting)
        for r in range(len(k_effs)):
            if drafting[r]:
                drafted[r] += 1
                tok = None if picks is None else picks[r]
                if tok is not None:
                    out[r].append(tok)
                drafting[r] = tok not in stop and drafted[r] < k_effs[r]
        last = not any(drafting)
        yield i + 1, (i + 1 if last else k_max)  # a window ends early once no row drafts
        if last:
            break
    if picks is None:  # kept on the device: the window's one read of its proposals
        for r, row in enumerate(steps.read()):
            row = row[:drafted[r]]
            cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
            out[r].extend(row[:cut])


class HostSteps:
    """Each step's tokens picked on the host (sampling, or greedy without a device feed)."""

    def __init__(self, kv: BatchCache, feeds: list[list[int]], pick):
        self.kv, self.feeds, self.pick = kv, feeds, pick
        self.blocks: list[list[int]] = []

    def prepare(self, i: int, drafting: list[bool]):
        self.blocks = [f if d else f[-1:] for f, d in zip(self.feeds, drafting)]
        return self.kv.shape(self.blocks)

    def run(self, i: int, drafting: list[bool]) -> list[int | None]:
        logits = self.kv.forward(self.blocks, live=drafting)
        picks: list[int | None] = [None] * len(self.feeds)
        for r in range(len(self.feeds)):
            if drafting[r]:
                picks[r] = tok = self.pick(r, logits[r, -1])
                self.feeds[r] = [tok]
        return picks


class DeviceSteps:
    """Each step's greedy choice (the argmax) kept on the device as the next step's input."""

    def __init__(self, kv: BatchCache, feeds: list[list[int]], pick=None):
        self.kv, self.feeds = kv, feeds
        self.chosen: list[torch.Tensor] = []  # per step, every row's argmax [B] (on the device)
        # Each row's next input: its last proposal, or (a row that no longer drafts: a hole)
        # the last token it fed, as the host path feeds it.
        with host_side():
            feed = torch.tensor([f[-1] for f in feeds])
        self.feed = to_device(feed, kv.device)
        self.blocks: list[list[int]] = []

    def prepare(self, i: int, drafting: list[bool]):
        self.blocks = [f if d else f[-1:] for f, d in zip(self.feeds, drafting)] if i == 0 \
            else [[0]] * len(self.feeds)
        return self.kv.shape(self.blocks)

    def run(self, i: int, drafting: list[bool]) -> None:
        logits = self.kv.forward(self.blocks, live=drafting,
                                 device_ids=None if i == 0 else self.feed[:, None])
        tok = logits[:, -1].argmax(dim=-1)
        self.chosen.append(tok)
        if not all(drafting):
            with host_side():
                live = torch.tensor(drafting)
            self.feed = torch.where(to_device(live, self.kv.device), tok, self.feed)
        else:
            self.feed = tok
        return None

    def read(self) -> list[list[int]]:
        return torch.stack(self.chosen, dim=1).tolist()


def draft_steps(kv: BatchCache, feeds: list[list[int]], k_effs: list[int], pick,
                stop: set[int], out: list[list[int]], events, on_device: bool = False):
    """`run_steps` over the batch cache `kv`: row r feeds `feeds[r]` first (its tokens the
    draft has not seen, ending with the pending one), then its last proposal; a row that no
    longer drafts feeds its last token as a hole. `pick(r, logits_row)` chooses row r's token
    on the host; `on_device` (greedy): each step's argmax stays on the device and is the next
    step's input."""
    steps = (DeviceSteps if on_device else HostSteps)(kv, feeds, pick)
    yield from run_steps(steps, k_effs, stop, out, events)


class SharedKV:
    """The target's own instance (`shared`, a `DraftMode`) drafts over the target's cache with
    its draft mode switched in; the proposals' KV is cropped once the window has drafted."""

    def __init__(self, shared):
        self.shared = shared

    def start(self, target: BatchCache) -> None:
        """After the prefill (the target's cache is the draft's: nothing to make)."""

    held_bytes = 0  # no KV of its own: the target's cache is counted as the target's

    def steps(self, kv: BatchCache, seqs: list[list[int]], k_effs: list[int], pick,
              stop: set[int], out: list[list[int]], events, on_device: bool = False):
        """`draft_steps` for rows whose committed tokens are `seqs` (each feeds its pending
        token, the last of its sequence)."""
        base = kv.length
        with self.shared.draft():
            yield from draft_steps(kv, [seq[-1:] for seq in seqs], k_effs, pick, stop, out,
                                   events, on_device)
        kv.crop(base)

    def commit(self, n_valid: list[int]) -> None:
        """After verification (nothing of the draft's own to keep)."""

    def select(self, rows: list[int]) -> None:
        """Finished rows left the target's cache, which is the draft's."""


class Events:
    """The loop's events, and who hears them, in the order given:
    - `forward(phase, tokens, context, rows)` before every forward: `rows` sequences of `tokens`
      positions each (padding included), attending over `context` positions (holes included);
      phase: "prefill" | "decode" (greedy) | "draft" | "verify" (speculative);
    - `draft_step(step, last)` after each draft step (1-based; `last`: the window's last step);
    - `window_end()` once a window's tokens are committed.
    An observer defines the events it hears, no more: the compute clock (clock/observer.py), the
    demand statistics (offload/runtime.py `DemandStats`), a second draft instance's clock, the
    window prefetcher (offload/prefetch.py). The engine lists them (decoding/engines.py); the
    loops, and a draft's steps for its own forwards, tell them."""

    def __init__(self, *observers):
        self.observers = [o for o in observers if o is not None]

    def _tell(self, event: str, *args) -> None:
        for observer in self.observers:
            heard = getattr(observer, event, None)
            if heard is not None:
                heard(*args)

    def forward(self, phase: str, tokens: int, context: int, rows: int = 1) -> None:
        self._tell("forward", phase, tokens, context, rows)

    def draft_step(self, step: int, last: int) -> None:
        self._tell("draft_step", step, last)

    def window_end(self) -> None:
        self._tell("window_end")


@dataclass
class SpecStats:
    k: int
    windows: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    accepted_lens: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)  # the draft depth of each window
    draft_s: list[float] = field(default_factory=list)  # clock time of each window's draft
    verify_s: list[float] = field(default_factory=list)  # ... and of its verification

    def as_record(self) -> dict:
        mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
        return {"k": self.k, "windows": self.windows, "drafted": self.drafted,
                "draft_ms_per_window": mean(self.draft_s) * 1e3,
                "verify_ms_per_window": mean(self.verify_s) * 1e3,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else float("nan"),
                "mean_accepted_len": (sum(self.accepted_lens) / len(self.accepted_lens)
                                      if self.accepted_lens else float("nan")),
                "accepted_lens": self.accepted_lens, "k_windows": self.ks,
                "k_window_mean": sum(self.ks) / len(self.ks) if self.ks else float("nan")}


class Rows:
    """The batch's requests: each one's committed tokens and their clock marks, its limit and
    statistics; `live[r]` is the request in cache row r. A row that commits its stop token or
    its last token leaves the batch while the others go on (the positions one row rejected
    become holes of the shared cache, so no row is cut to another's acceptance).
    `on_commit[b]` (None, or None for a request: no listener) hears request b's commits."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int | list[int], k: int,
                 stop: set[int], start, on_commit: list | None = None):
        n = len(prompts)
        self.stop, self.start = stop, start
        self.on_commit = on_commit
        self.seqs = [list(p) for p in prompts]  # per request: prompt + committed tokens
        self.tokens: list[list[int]] = [[] for _ in range(n)]  # committed tokens
        self.times: list[list] = [[] for _ in range(n)]  # the timeline's mark at each commit
        self.limit = limits_of(max_new_tokens, n)
        self.stats = [SpecStats(k=k) for _ in range(n)]
        self.spans: list[list[tuple]] = [[] for _ in range(n)]  # (draft, verify, done) marks
        self.live = list(range(n))

    def live_seqs(self) -> list[list[int]]:
        return [self.seqs[b] for b in self.live]

    def pick(self, pick):
        """`pick(request, logits)` as the draft calls it, by cache row (the row's request read
        at each call: rows leave between windows)."""
        return lambda r, logits: pick(self.live[r], logits)

    def quotas(self, k: int) -> list[int]:
        """Per live row, the draft tokens still wanted after the target's next one (<= k)."""
        return [min(k, self.limit[b] - len(self.tokens[b]) - 1) for b in self.live]

    def _commit(self, b: int, new: list[int], now) -> bool:
        """Commit request b's tokens in order, up to its stop token or its limit (its
        listener hears exactly those); True once it is finished (or its listener said False:
        its client is gone)."""
        self.seqs[b].extend(new)
        tokens, done = self.tokens[b], False
        before = len(tokens)
        for t in new:
            tokens.append(t)
            self.times[b].append(now)
            if t in self.stop or len(tokens) >= self.limit[b]:
                done = True
                break
        if self.on_commit is not None and self.on_commit[b] is not None and len(tokens) > before:
            if self.on_commit[b](tokens[before:]) is False:
                done = True
        return done

    def commit_first(self, first: list[int], now) -> list[int]:
        """The prefill's token of every request; returns the rows still going."""
        return [r for r, b in enumerate(self.live) if not self._commit(b, [first[b]], now)]

    def commit_window(self, verdicts: list[tuple[int, list[int]]], proposals: list[list[int]],
                      k: int, marks: tuple) -> tuple[list[int], list[int]]:
        """One window's (kept, tokens) per row; returns the rows still going, and per row the
        tokens whose KV a separate draft keeps (those it fed that were kept)."""
        going, draft_kept = [], []
        for r, b in enumerate(self.live):
            kept, new = verdicts[r]
            props = proposals[r]
            st = self.stats[b]
            st.ks.append(k)
            st.windows += 1
            st.drafted += len(props)
            st.accepted += kept
            st.accepted_lens.append(kept)
            self.spans[b].append(marks)
            draft_kept.append(len(self.seqs[b]) + min(kept, max(len(props) - 1, 0)))
            if not self._commit(b, new, marks[-1]):
                going.append(r)
        return going, draft_kept

    def leave(self, going: list[int], kv: BatchCache, draft) -> None:
        """Only rows `going` stay, in the cache and in a separate draft's."""
        if not going:
            self.live = []
            return
        kv.select(going)
        draft.select(going)
        self.live = [self.live[r] for r in going]

    def generations(self, timeline, memory) -> list[Generation]:
        """The requests are over: their marks read as seconds."""
        peak, source = memory.peak()
        gens = []
        for b, st in enumerate(self.stats):
            st.draft_s = [timeline.elapsed(t0, t1, wait=True) for t0, t1, _ in self.spans[b]]
            st.verify_s = [timeline.elapsed(t1, t2, wait=True) for _, t1, t2 in self.spans[b]]
            gen = Generation(tokens=self.tokens[b],
                             commit_times_s=[timeline.timestamp(m) for m in self.times[b]],
                             start_time_s=timeline.timestamp(self.start), peak_mem_bytes=peak,
                             peak_mem_source=source)
            gen.stats.update(st.as_record())
            gens.append(gen)
        return gens


class WindowDepth:
    """Each window's K as `adaptive` (an `AdaptiveDepth`) chooses it; it hears each window
    once the device has passed it (its marks readable without a wait). A loop with a fixed K
    has none."""

    def __init__(self, adaptive, timeline):
        self.adaptive, self.timeline = adaptive, timeline
        self.unheard: list[tuple] = []  # (k, accepted, rejected, steps, draft, verify, done)

    def next_k(self) -> int:
        self._tell()
        return self.adaptive.next_k()

    def observe(self, k: int, verdicts: list[tuple[int, list[int]]],
                proposals: list[list[int]], marks: tuple) -> None:
        accepted = sum(kept for kept, _ in verdicts)
        rejected = sum(kept < len(props) for (kept, _), props in zip(verdicts, proposals))
        view = self.adaptive.view
        streamed = 0.0
        if view is not None:  # the verification's routing, on the host already
            view.rows = len(verdicts)
            streamed = view.sample()
        self.unheard.append((k, accepted, rejected, max(len(p) for p in proposals), streamed,
                             *marks))
        self._tell()

    def _tell(self) -> None:
        """Each window the device has passed, in order (no wait)."""
        while self.unheard:
            k, accepted, rejected, steps, streamed, t0, t1, t2 = self.unheard[0]
            verify_s = self.timeline.elapsed(t1, t2)
            if verify_s is None:
                return
            self.adaptive.observe(k, accepted, rejected, self.timeline.elapsed(t0, t1), steps,
                                  verify_s, streamed)
            self.unheard.pop(0)


# -- acceptance: which proposals a row keeps ----------------------------------------------
# Each way of choosing a token from logits (the draft's picks, the prefill's first token) and
# of accepting a row's proposals against the verification logits. `Greedy`: the longest
# prefix equal to the target's own argmax choices, then the target's token, so the output is
# the target's greedy output token for token; its draft choices stay on the device.
# `Sampled`: speculative sampling (`accept_sampled`), every committed token distributed as
# the target's sampling at temperature T, one generator per request.

def accept_sampled(p: torch.Tensor, q: torch.Tensor, proposals: list[int],
                   gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): p [n+1, V] target
    probabilities at each verified position, q [n, V] the draft's at the n proposals.
    Proposal i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the
    next token is drawn from norm(max(0, p_i - q_i)); if all n are kept, from p_n. Every
    committed token is then distributed exactly as the target's. Returns (kept, next token)."""
    for i, x in enumerate(proposals):
        r = torch.rand((), generator=gen).item()
        if r * q[i, x] < p[i, x]:  # r < p/q without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=gen))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=gen))


class Greedy:
    """Temperature 0: the target's greedy tokens."""

    on_device = True  # the draft's argmax choices stay on the device (`draft_steps`)

    def pick(self, request: int, logits: torch.Tensor) -> int:
        return int(logits.argmax())  # host sync: the next forward needs it

    draft_pick = pick  # a draft's choice on the host: the same (nothing kept for acceptance)

    def read(self, logits: torch.Tensor) -> None:
        """The verification logits [B, width, V] read once: every position's argmax."""
        self.targets = logits.argmax(dim=-1).tolist()  # host sync: acceptance is a host decision

    def accept(self, row: int, request: int, logits: torch.Tensor, at: int,
               proposals: list[int]) -> tuple[int, list[int]]:
        """Row `row`'s longest prefix of proposals equal to the target's choices (its block
        starts at column `at`), then the target's token: (kept, the tokens to commit)."""
        target = self.targets[row][at:]
        kept = 0
        while kept < len(proposals) and proposals[kept] == target[kept]:
            kept += 1
        return kept, proposals[:kept] + [target[kept]]


class Sampled:
    """Temperature T > 0: speculative sampling, request r drawing from `generators[r]`."""

    on_device = False  # the draft samples on the host and keeps its probabilities

    def __init__(self, temperature: float, generators: list[torch.Generator]):
        self.temperature, self.generators = temperature, generators
        self.q_rows: list[list[torch.Tensor]] = [[] for _ in generators]  # the draft's probs

    def pick(self, request: int, logits: torch.Tensor) -> int:
        """The target's token (the prefill's): drawn, nothing kept."""
        q = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        return int(torch.multinomial(q, 1, generator=self.generators[request]))

    def draft_pick(self, request: int, logits: torch.Tensor) -> int:
        """A draft's proposal: drawn, its probabilities kept for the window's `accept`."""
        q = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        self.q_rows[request].append(q)
        return int(torch.multinomial(q, 1, generator=self.generators[request]))

    def read(self, logits: torch.Tensor) -> None:
        """Nothing read ahead: each row's probabilities are taken in `accept`."""

    def accept(self, row: int, request: int, logits: torch.Tensor, at: int,
               proposals: list[int]) -> tuple[int, list[int]]:
        p = torch.softmax(logits[row, at:].float().cpu() / self.temperature, dim=-1)
        q = torch.stack(self.q_rows[request]) if self.q_rows[request] else p[:0]
        self.q_rows[request] = []  # the window's draft probabilities, used once
        kept, nxt = accept_sampled(p, q, proposals, self.generators[request])
        return kept, proposals[:kept] + [nxt]
