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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from specter.engine import Generation, forward_logits, new_cache


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
    draft_s: list[float] = field(default_factory=list)  # clock time of each window's draft
    verify_s: list[float] = field(default_factory=list)  # ... and of its verification

    def as_record(self) -> dict:
        mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
        return {"k": self.k, "windows": self.windows,
                "draft_ms_per_window": mean(self.draft_s) * 1e3,
                "verify_ms_per_window": mean(self.verify_s) * 1e3,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else float("nan"),
                "mean_accepted_len": (sum(self.accepted_lens) / len(self.accepted_lens)
                                      if self.accepted_lens else float("nan")),
                "accepted_lens": self.accepted_lens}


class SeparateDraft:
    """A draft that is a second model with its own KV cache (SpecMoEOff's layout), instead of
    the shared instance's draft mode over the target's cache. Its cache keeps the draft's KV of
    committed tokens; tokens it has not seen (the target's corrections) are fed in one block
    at the start of the next window."""

    def __init__(self, model):
        self.model = model
        self.cache = None

    def start(self) -> None:
        self.cache = new_cache(self.model)

    def propose(self, seq: list[int], k_eff: int, pick, tell, stop: set[int], device,
                after_step=None) -> list[int]:
        have = self.cache.get_seq_length()
        feed = seq[have:]  # the committed tokens it has not seen, ending with `pending`
        proposals: list[int] = []
        for i in range(k_eff):
            tell(len(feed), have + len(feed), "draft")
            logits = forward_logits(self.model, torch.tensor([feed], device=device), self.cache)
            have += len(feed)
            tok = pick(logits[-1])
            proposals.append(tok)
            feed = [tok]
            if after_step:  # a stop token ends the window early: its last step is this one
                after_step(i + 1, i + 1 if tok in stop else k_eff)
            if tok in stop:
                break
        return proposals

    def sync(self, target_cache) -> None:
        """At a window's start, before `propose` (own KV: nothing to do)."""

    def commit(self, n_valid: int) -> None:
        """Keep the draft's KV of the first `n_valid` tokens only."""
        excess = self.cache.get_seq_length() - n_valid
        if excess > 0:
            self.cache.crop(-excess)


class CopiedKVDraft(SeparateDraft):
    """A second model whose KV is a copy of the target's committed KV, made at the start of
    every window (the authors' artifact's "SIC off": weights apart, KV copied per window, not
    shared). The draft so reads exactly the target's KV, as the shared instance does: the
    same proposals, the same acceptance; what it costs is the copy (`on_copy(tokens, cache)`
    is told of each, to charge it) and the copy's memory."""

    def __init__(self, model, on_copy=None):
        super().__init__(model)
        self.on_copy = on_copy

    def sync(self, target_cache) -> None:
        self.cache = copy.deepcopy(target_cache)  # every layer's K and V, device to device
        if self.on_copy is not None:
            self.on_copy(self.cache.get_seq_length(), self.cache)

    def commit(self, n_valid: int) -> None:
        """Nothing kept: the next window copies the target's KV afresh."""
        self.cache = None


@torch.no_grad()
def speculative_greedy(model, shared, prompt_ids: list[int], max_new_tokens: int, k: int,
                       device: torch.device, clock, stop: set[int], memory,
                       before_forward=None, on_window=None, temperature: float = 0.0,
                       generator: torch.Generator | None = None,
                       separate: SeparateDraft | None = None, after_draft_step=None) -> Generation:
    """Self-speculative decoding, greedy (temperature 0: the target's greedy tokens) or
    sampled (temperature > 0: `accept_sampled`, tokens distributed as the target's sampling);
    `before_forward(tokens, context, phase)` is told of every forward (phase: "prefill" |
    "draft" | "verify"); `on_window(stats)` after each window; `separate`: draft with a
    second model and its own cache (or, `CopiedKVDraft`, a per-window copy of the target's)
    instead of `shared`; `after_draft_step(i, k_eff)` after each draft token (a prefetcher's
    hook; when a stop token ends the window early, k_eff is the steps actually drafted, so
    i == k_eff marks every window's last step)."""
    sampling = temperature > 0
    if sampling and generator is None:
        raise ValueError("sampling needs a torch.Generator (seeded per request)")
    if k < 1:
        raise ValueError(f"k must be at least 1 (got {k})")
    memory.start()
    cache = new_cache(model)
    start = clock.now()
    tokens: list[int] = []
    times: list[float] = []
    stats = SpecStats(k=k)
    tell = before_forward or (lambda *a: None)

    def pick(row: torch.Tensor, rows: list | None = None) -> int:
        if sampling:
            q = torch.softmax(row.float().cpu() / temperature, dim=-1)
            if rows is not None:
                rows.append(q)
            return int(torch.multinomial(q, 1, generator=generator))
        return int(row.argmax())  # host sync: the next forward needs it

    # 1. Prefill the prompt; its last logits give the target's first output token, committed
    #    now, as in autoregressive decoding (so TTFT and TPOT mean the same for every system:
    #    the first window's tokens are not committed together with the first token).
    n_prompt = len(prompt_ids)
    tell(n_prompt, n_prompt, "prefill")
    logits = forward_logits(model, torch.tensor([prompt_ids], device=device), cache)
    pending = pick(logits[-1])
    tokens.append(pending)
    times.append(clock.now())
    seq = list(prompt_ids) + [pending]  # committed token ids (prompt + outputs)
    memory.observe_cache(cache)
    if separate is not None:
        separate.start()
    if pending in stop:
        max_new_tokens = len(tokens)

    while len(tokens) < max_new_tokens:
        # 2. Draft: at most the tokens still wanted after the target's own next token.
        k_eff = min(k, max_new_tokens - len(tokens) - 1)
        proposals: list[int] = []
        q_rows: list[torch.Tensor] = []  # the draft's probabilities (sampling only)
        base = cache.get_seq_length()  # == len(seq) - 1
        t_draft = clock.now()
        if k_eff > 0 and separate is not None:
            separate.sync(cache)
            proposals = separate.propose(seq, k_eff, lambda row: pick(row, q_rows), tell, stop,
                                         device, after_draft_step)
        elif k_eff > 0:
            with shared.draft():
                tok = pending
                for i in range(k_eff):
                    tell(1, base + i + 1, "draft")
                    logits = forward_logits(model, torch.tensor([[tok]], device=device), cache)
                    tok = pick(logits[-1], q_rows)
                    proposals.append(tok)
                    if after_draft_step:  # a stop token ends the window early, at this step
                        after_draft_step(i + 1, i + 1 if tok in stop else k_eff)
                    if tok in stop:
                        break
            cache.crop(-(cache.get_seq_length() - base))
        t_verify = clock.now()
        stats.draft_s.append(t_verify - t_draft)
        # 3. Verify pending + proposals in one target forward.
        block = [pending] + proposals
        tell(len(block), base + len(block), "verify")
        logits = forward_logits(model, torch.tensor([block], device=device), cache,
                                logits_to_keep=len(block))
        # 4. Accept the longest matching prefix, then the target's next token (greedy), or
        #    by speculative sampling.
        if sampling:
            p = torch.softmax(logits.float().cpu() / temperature, dim=-1)
            q = torch.stack(q_rows) if q_rows else p[:0]
            n_acc, nxt = accept_sampled(p, q, proposals, generator)
            new = proposals[:n_acc] + [nxt]
        else:
            target = logits.argmax(dim=-1).tolist()  # host sync: acceptance is a host decision
            n_acc = 0
            while n_acc < len(proposals) and proposals[n_acc] == target[n_acc]:
                n_acc += 1
            new = proposals[:n_acc] + [target[n_acc]]
        stats.windows += 1
        stats.drafted += len(proposals)
        stats.accepted += n_acc
        stats.accepted_lens.append(n_acc)
        now = clock.now()
        stats.verify_s.append(now - t_verify)
        done = False
        for t in new:
            tokens.append(t)
            times.append(now)
            if t in stop or len(tokens) >= max_new_tokens:
                done = True
                break
        # 5. Keep the target's KV of the committed tokens only (all but the new pending one).
        if separate is not None:  # the draft's KV of tokens it fed that were kept
            separate.commit(len(seq) + min(n_acc, max(len(proposals) - 1, 0)))
        seq.extend(new)
        cache.crop(-(cache.get_seq_length() - (len(seq) - 1)))
        pending = new[-1]
        memory.observe_cache(cache)
        if on_window:
            on_window(stats)
        if done:
            break
    peak, source = memory.peak()
    gen = Generation(tokens=tokens, commit_times_s=times, start_time_s=start,
                     peak_mem_bytes=peak, peak_mem_source=source)
    gen.stats.update(stats.as_record())
    return gen
