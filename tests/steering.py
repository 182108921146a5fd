"""Drafts whose behaviour a test fixes by construction, whatever the trained weights.

A tiny model's INT4 draft is accepted, rejected and routes as its weights make it: another seed,
thread count or CPU trains other weights, so a test that needs a rejection, a wrong draft or a
precise plan must make it, not hope for it (docs/testing.md). Three ways:

- `steered_draft`: every proposal is planned. The draft still runs each step (its KV, routing
  and prefetches are real), but the token it feeds on and proposes is the target's own next
  token, or at a planned step one the target does not emit there.
- `exact_draft_layers`: draft experts computed exactly as the target's (from the host store),
  so the draft routes as verification will, up to rounding ties: a plan's precision near 1.
- `forced_predictions`: the window prefetcher is told the draft routed to experts that are not
  resident, so every plan copies something.
"""

from __future__ import annotations

import inspect

import torch


def _loop_state():
    """The decoding loop's committed tokens and live rows (`speculative_batch`'s locals)."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_name != "speculative_batch":
        frame = frame.f_back
    assert frame is not None, "steered_draft: not called from speculative_batch"
    rows = frame.f_locals["rows"]
    return rows.seqs, rows.live


def steered_draft(monkeypatch, batch: list[list[int]], reference: list[list[int]], vocab: int,
                  plan) -> dict[int, list[int]]:
    """Row b's proposal at step i of its window w is `reference[b]`'s next token (resident's
    output for request `batch[b]`), except at step `plan(b, w)` (None: no wrong step), where
    it is a token the target does not emit there. Greedy verification then accepts exactly
    min(plan, proposals) tokens of each window. Returns request -> the accepted lengths the
    plan implies, filled as the run goes (a window that drafts nothing, the last of a row one
    token short of its limit, never reaches the draft: it accepts 0)."""
    from specter.decoding import loop

    real = loop.draft_steps
    expected: dict[int, list[int]] = {b: [] for b in range(len(batch))}

    def steered(kv, feeds, k_effs, pick, stop, out, events, on_device=False):
        # (the steered choices are made per step on the host: `on_device` is not taken)
        seqs, live = _loop_state()
        step = [0] * len(feeds)
        wrong: dict[int, int] = {}

        def choose(r, row):
            pick(r, row)  # the draft's own choice, made and discarded
            b, i = live[r], step[r]
            step[r] += 1
            done = len(seqs[b]) - len(batch[b])  # committed tokens, the pending one included
            ref = reference[b]
            tok = ref[done + i] if done + i < len(ref) else ref[-1]
            if i == plan(b, len(expected[b])):
                tok = (tok + 1) % vocab
                wrong[r] = i
            return tok

        yield from real(kv, feeds, k_effs, choose, stop, out, events)
        for r, props in enumerate(out):
            expected[live[r]].append(min(wrong.get(r, len(props)), len(props)))

    monkeypatch.setattr(loop, "draft_steps", steered)
    return expected


def exact_draft_layers(model, store) -> list:
    """Per MoE layer, draft experts that compute what the target's do, from the host store's
    full-precision copies: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""
    from specter.models.introspect import experts_modules

    mods = [m for _, m in experts_modules(model)]

    def layer(l: int):
        mod = mods[l]

        def forward(hidden, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden)
            for e in top_k_index.unique().tolist():
                tok, pos = torch.where(top_k_index == e)
                gate_up, down = store.layout.views(store.expert(l, e))
                act = mod._apply_gate(hidden[tok] @ gate_up.to(hidden).T)
                y = (act @ down.to(hidden).T) * top_k_weights[tok, pos, None].to(hidden.dtype)
                out.index_add_(0, tok, y)
            return out
        return forward

    return [layer(l) for l in range(len(mods))]


def forced_predictions(engine) -> None:
    """Tell `engine`'s window prefetcher, at every draft experts call, that the draft routed
    each token to experts that are not resident (the first k non-resident ids of the layer),
    so every plan has copies to issue."""
    window = engine.window
    cache = window.cache
    listeners = (engine.draft.draft_mode or engine.draft.instance).draft_listeners
    real = window.on_draft_experts

    def forced(layer: int, top_k_index: torch.Tensor) -> None:
        resident = cache.resident_set(layer)
        t, k = top_k_index.shape
        absent = [e for e in range(cache.store.layout.num_experts) if e not in resident][:k]
        if len(absent) < k:
            return real(layer, top_k_index)
        real(layer, torch.tensor([absent] * t, dtype=top_k_index.dtype))

    for i, fn in enumerate(listeners):
        if fn == real:
            listeners[i] = forced
