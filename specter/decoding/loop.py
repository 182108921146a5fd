"""Self-speculative greedy decoding over one model instance and one KV cache.

Owns: the draft / verify / accept loop. The INT4 draft (`SelfDraft.draft()`) proposes K
tokens one forward at a time, appending temporary entries to the cache; they are cropped;
the target verifies the pending token and the K proposals in one forward of K+1 positions;
the longest prefix of proposals equal to the target's own greedy choices is accepted, plus
the target's token after it (the correction, or a bonus when all K match). The cache is then
cropped to the committed tokens, so it holds exactly the target's KV for them, and the output
is the target's greedy output token for token.
Does not own: where experts live (the target mode's experts implementation), what is
prefetched during the draft (the orchestrator).

Invariant between windows: the cache holds the target's KV for every committed token but the
last one (`pending`), which the next window feeds first.

Time: the loop takes the clock's marks (`mark()`: a CUDA event on the compute stream, never a
device-wide wait) and turns them into seconds after the request's last token; the host waits
only to read values (each window's acceptance, the greedy picks), on the compute stream.
`AdaptiveDepth` hears each window once the device has passed it (at once on the modelled
clocks, a window or so later on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specter.engine import BatchCache, Generation


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


def draft_steps(kv: BatchCache, feeds: list[list[int]], k_effs: list[int], pick, tell,
                stop: set[int], after_step=None, on_device: bool = False) -> list[list[int]]:
    """Up to `k_effs[r]` proposals for each row r of `kv`, one draft forward per step: row r
    feeds `feeds[r]` first (its tokens the draft has not seen, ending with the pending one),
    then its last proposal; a row that has drafted a stop token or its quota feeds its last
    token as a hole. `pick(r, logits_row)` chooses row r's token; `after_step(i, k_eff)`
    after each step (k_eff: the window's last step, early once no row drafts).

    `on_device` (greedy): each step's choice (the argmax) stays on the device and is the next
    step's input; the window's proposals are read once, after its last step, and each row's
    are cut after its first stop token. A row so drafts its whole quota even past a stop token
    (those steps' KV is discarded with the window's, their tokens never proposed): the draft
    step waits for the host only at the window's end."""
    if on_device:
        return _draft_steps_on_device(kv, feeds, k_effs, tell, stop, after_step)
    drafting = [k > 0 for k in k_effs]
    proposals: list[list[int]] = [[] for _ in feeds]
    k_max = max(k_effs)
    for i in range(k_max):
        blocks = [f if d else f[-1:] for f, d in zip(feeds, drafting)]
        width = max(len(b) for b in blocks)
        tell(width, kv.length + width, "draft", rows=kv.rows)
        logits = kv.forward(blocks, live=drafting)
        for r in range(len(feeds)):
            if drafting[r]:
                tok = pick(r, logits[r, -1])
                proposals[r].append(tok)
                feeds[r] = [tok]
                drafting[r] = tok not in stop and len(proposals[r]) < k_effs[r]
        last = not any(drafting)
        if after_step:  # a window ends early when every row has stopped drafting
            after_step(i + 1, i + 1 if last else k_max)
        if last:
            break
    return proposals


def _draft_steps_on_device(kv: BatchCache, feeds: list[list[int]], k_effs: list[int], tell,
                           stop: set[int], after_step=None) -> list[list[int]]:
    """`draft_steps` with the greedy choices kept on the device (see there)."""
    drafting = [k > 0 for k in k_effs]
    drafted = [0] * len(feeds)
    chosen: list[torch.Tensor] = []  # per step, every row's argmax [B] (on the device)
    k_max = max(k_effs)
    # Each row's next input: its last proposal, or (a row that no longer drafts: a hole) the
    # last token it fed, as the host path feeds it.
    feed = torch.tensor([f[-1] for f in feeds], device=kv.device)
    for i in range(k_max):
        blocks = [f if d else f[-1:] for f, d in zip(feeds, drafting)] if i == 0 \
            else [[0]] * len(feeds)
        width = max(len(b) for b in blocks)
        tell(width, kv.length + width, "draft", rows=kv.rows)
        logits = kv.forward(blocks, live=drafting, device_ids=None if i == 0 else feed[:, None])
        tok = logits[:, -1].argmax(dim=-1)
        chosen.append(tok)
        feed = tok if all(drafting) else torch.where(torch.tensor(drafting, device=kv.device),
                                                     tok, feed)
        for r in range(len(feeds)):
            if drafting[r]:
                drafted[r] += 1
                drafting[r] = drafted[r] < k_effs[r]
        last = not any(drafting)
        if after_step:
            after_step(i + 1, i + 1 if last else k_max)
        if last:
            break
    table = torch.stack(chosen, dim=1).tolist()  # the window's one read of its proposals
    proposals = []
    for r in range(len(feeds)):
        row = table[r][:drafted[r]]
        cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
        proposals.append(row[:cut])
    return proposals


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

    def propose(self, seqs: list[list[int]], k_effs: list[int], pick, tell, stop: set[int],
                after_step=None, on_device: bool = False) -> list[list[int]]:
        """Up to `k_effs[r]` proposals for each row r whose committed tokens are `seqs[r]`;
        `pick(r, logits_row)` chooses row r's token (`on_device`: the greedy argmax, kept on
        the device: `draft_steps`)."""
        feeds = [seq[self.kv.valid[r]:] for r, seq in enumerate(seqs)]  # unseen, then pending
        return draft_steps(self.kv, feeds, k_effs, pick, tell, stop, after_step, on_device)

    def sync(self, target: BatchCache) -> None:
        """At a window's start, before `propose` (own KV: nothing to do)."""

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


@torch.no_grad()
def speculative_greedy(model, shared, prompt_ids: list[int], max_new_tokens: int, k: int,
                       device: torch.device, clock, stop: set[int], memory,
                       before_forward=None, on_window=None, temperature: float = 0.0,
                       generator: torch.Generator | None = None,
                       separate: SeparateDraft | None = None, after_draft_step=None) -> Generation:
    """One request: `speculative_batch` of one row."""
    return speculative_batch(model, shared, [prompt_ids], max_new_tokens, k, device, clock, stop,
                             memory, before_forward, on_window, temperature,
                             None if generator is None else [generator], separate,
                             after_draft_step)[0]


@torch.no_grad()
def speculative_batch(model, shared, prompts: list[list[int]], max_new_tokens: int, k: int,
                      device: torch.device, clock, stop: set[int], memory,
                      before_forward=None, on_window=None, temperature: float = 0.0,
                      generators: list[torch.Generator] | None = None,
                      separate: SeparateDraft | None = None,
                      after_draft_step=None, depth=None) -> list[Generation]:
    """Self-speculative decoding of a batch, greedy (temperature 0: each row gets the target's
    greedy tokens) or sampled (temperature > 0: `accept_sampled`, row r drawing from
    `generators[r]`). Every window drafts for all unfinished rows together and verifies them
    in one target forward; each row accepts its own prefix plus the target's token, and the
    positions it rejected become holes of the `BatchCache` (no row is cut to another's
    acceptance). `before_forward(tokens, context, phase, rows)` is told of every forward
    (phase: "prefill" | "draft" | "verify"); `on_window(stats)` after each window;
    `separate`: draft with a second model and its own cache (or, `CopiedKVDraft`, a
    per-window copy of the target's) instead of `shared`; `after_draft_step(i, k_eff)` after
    each draft step (a prefetcher's hook; k_eff is the window's last step, which comes
    early once every row has drafted a stop token or its quota, so i == k_eff marks every
    window's last step); `depth` (an `AdaptiveDepth`): the K of each window instead of `k`,
    told what each window measured."""
    sampling = temperature > 0
    if sampling and (generators is None or len(generators) != len(prompts)):
        raise ValueError("sampling needs one torch.Generator per request (seeded per request)")
    if k < 1:
        raise ValueError(f"k must be at least 1 (got {k})")
    if not prompts or any(not p for p in prompts):
        raise ValueError("every request needs at least one prompt token")
    memory.start()
    kv = BatchCache(model, device, len(prompts))
    start = clock.mark()
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    times: list[list] = [[] for _ in range(n)]  # the clock's mark at each commit
    stats = [SpecStats(k=k) for _ in range(n)]
    limit = [max_new_tokens] * n
    tell = before_forward or (lambda *a, **kw: None)
    live = list(range(n))  # the request of each cache row
    q_rows: list[list[torch.Tensor]] = [[] for _ in range(n)]  # draft probabilities (sampling)
    spans: list[list[tuple]] = [[] for _ in range(n)]  # per row, (draft, verify, done) marks
    heard: list[tuple] = []  # windows `depth` has not heard yet: (k, accepted, rejected,
    #                          steps, draft mark, verify mark, done mark)

    def tell_depth() -> None:
        """Each window the device has passed, in order, to `depth` (no wait)."""
        while heard:
            k_w, acc, rej, steps, t0, t1, t2 = heard[0]
            verify_s = clock.elapsed(t1, t2)
            if verify_s is None:
                return
            depth.observe(k_w, acc, rej, clock.elapsed(t0, t1), steps, verify_s)
            heard.pop(0)

    def pick(b: int, row: torch.Tensor) -> int:
        if sampling:
            q = torch.softmax(row.float().cpu() / temperature, dim=-1)
            q_rows[b].append(q)
            return int(torch.multinomial(q, 1, generator=generators[b]))
        return int(row.argmax())  # host sync: the next forward needs it

    def commit(b: int, new: list[int], now: float) -> bool:
        """Commit row b's tokens in order; True once the row is finished."""
        for t in new:
            tokens[b].append(t)
            times[b].append(now)
            if t in stop or len(tokens[b]) >= limit[b]:
                return True
        return False

    def leave(going: list[int]) -> None:
        nonlocal live
        if not going:
            live = []
            return
        kv.select(going)
        if separate is not None:
            separate.select(going)
        live = [live[r] for r in going]

    # 1. Prefill the prompts; each row's last logits give the target's first output token,
    #    committed now, as in autoregressive decoding (so TTFT and TPOT mean the same for
    #    every system: the first window's tokens are not committed together with the first).
    width = max(len(p) for p in prompts)
    tell(width, width, "prefill", rows=n)
    logits = kv.forward([list(p) for p in prompts])
    pending = [pick(b, logits[b, -1]) for b in range(n)]
    now = clock.mark()
    seqs = [list(p) + [pending[b]] for b, p in enumerate(prompts)]  # committed ids per row
    memory.observe_cache(kv.cache)
    if separate is not None:
        separate.start(n, device)
    leave([r for r, b in enumerate(live) if not commit(b, [pending[b]], now)])

    while live:
        # 2. Draft: per row at most the tokens still wanted after the target's next one.
        if depth is not None:
            tell_depth()
        k_now = depth.next_k() if depth is not None else k
        k_effs = [min(k_now, limit[b] - len(tokens[b]) - 1) for b in live]
        proposals: list[list[int]] = [[] for _ in live]
        for b in live:
            q_rows[b] = []
        base = kv.length
        t_draft = clock.mark()
        if max(k_effs) > 0 and separate is not None:
            separate.sync(kv)
            proposals = separate.propose([seqs[b] for b in live], k_effs,
                                         lambda r, row: pick(live[r], row), tell, stop,
                                         after_draft_step, on_device=not sampling)
        elif max(k_effs) > 0:
            with shared.draft():
                proposals = draft_steps(kv, [[pending[b]] for b in live], k_effs,
                                        lambda r, row: pick(live[r], row), tell, stop,
                                        after_draft_step, on_device=not sampling)
            kv.crop(base)
        t_verify = clock.mark()
        # 3. Verify every row's pending token + proposals in one target forward.
        blocks = [[pending[b]] + proposals[r] for r, b in enumerate(live)]
        width = max(len(block) for block in blocks)
        tell(width, kv.length + width, "verify", rows=len(live))
        logits = kv.forward(blocks, logits_to_keep=width)  # [B, width, V], right-aligned
        # 4. Each row accepts its longest matching prefix, then the target's next token
        #    (greedy), or by speculative sampling.
        if not sampling:
            targets = logits.argmax(dim=-1).tolist()  # host sync: acceptance is a host decision
        now = clock.mark()
        going, kept = [], []
        accepted = rejected = 0
        for r, b in enumerate(live):
            props, at = proposals[r], width - len(blocks[r])
            if sampling:
                p = torch.softmax(logits[r, at:].float().cpu() / temperature, dim=-1)
                q = torch.stack(q_rows[b]) if q_rows[b] else p[:0]
                n_acc, nxt = accept_sampled(p, q, props, generators[b])
                new = props[:n_acc] + [nxt]
            else:
                target = targets[r][at:]
                n_acc = 0
                while n_acc < len(props) and props[n_acc] == target[n_acc]:
                    n_acc += 1
                new = props[:n_acc] + [target[n_acc]]
            accepted += n_acc
            rejected += n_acc < len(props)
            st = stats[b]
            st.ks.append(k_now)
            st.windows += 1
            st.drafted += len(props)
            st.accepted += n_acc
            st.accepted_lens.append(n_acc)
            spans[b].append((t_draft, t_verify, now))
            if not commit(b, new, now):
                going.append(r)
            # the draft's KV of the tokens it fed that were kept (a separate draft's own)
            kept.append(len(seqs[b]) + min(n_acc, max(len(props) - 1, 0)))
            seqs[b].extend(new)
            pending[b] = new[-1]
            # 5. Keep the target's KV of the committed tokens only (all but the new pending).
            kv.keep(r, len(seqs[b]) - 1)
        kv.trim()
        if depth is not None:
            heard.append((k_now, accepted, rejected, max(len(p) for p in proposals),
                          t_draft, t_verify, now))
            tell_depth()
        if separate is not None and max(k_effs) > 0:
            separate.commit(kept)
        memory.observe_cache(kv.cache)
        if on_window:
            on_window(stats)
        leave(going)
    peak, source = memory.peak()
    gens = []
    for b in range(n):  # the request is over: its marks read as seconds
        st = stats[b]
        st.draft_s = [clock.elapsed(t0, t1, wait=True) for t0, t1, _ in spans[b]]
        st.verify_s = [clock.elapsed(t1, t2, wait=True) for _, t1, t2 in spans[b]]
        gen = Generation(tokens=tokens[b], commit_times_s=[clock.timestamp(m) for m in times[b]],
                         start_time_s=clock.timestamp(start), peak_mem_bytes=peak,
                         peak_mem_source=source)
        gen.stats.update(st.as_record())
        gens.append(gen)
    return gens
