"""`Engine.generate(..., on_commit=)`: every engine streams a request's tokens as it commits
them (specter/decoding/batch.py's `Engine` contract).

On tiny_deepseek, for the eager greedy loop (resident), the compiled greedy step (resident
with system.compile=on: compiled_decode.py), greedy offloading (lru), speculative decoding
(specter: decoding/loop.py) and Hugging Face `generate` (transformers): the listener's chunks
add up to `Generation.tokens` exactly, the greedy paths send one token per step, the
speculative one the prefill's token and then each window's accepted proposals plus the
target's token; a stop token and `max_new_tokens` cut the stream where they cut the tokens;
and a request without a listener decodes as before (same tokens, same commit times).
The speculative windows' acceptance is planned (`steered_draft`), not hoped for.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import PROMPTS
from steering import steered_draft
from specter.budget import resolve_slots
from specter.config import RunConfig
from specter.placement.loader import load_model
from specter.compose import job_of
from specter.recipes import build_engine

from test_batch import A100  # the virtual A100 with host rates (lru_hybrid's)

CPU = torch.device("cpu")
N_NEW = 14
K = 3
SYSTEMS = {
    "resident": {"name": "resident", "compile": "off"},  # greedy_decode_batch
    "resident_compiled": {"name": "resident", "compile": "on", "compile_backend": "eager"},
    "lru": {"name": "lru"},  # greedy, offloaded
    "specter": {"name": "specter"},  # speculative
    "transformers": {"name": "transformers"},  # HF generate, accelerate's hooks
}


def build(system: str, stop: set[int]):
    """`system` on a fresh tiny_deepseek (offloading mutates it) stopping at `stop` only."""
    cfg = RunConfig.from_dict({
        "model": {"name": "tiny_deepseek", "source": "project", "stands_for": "deepseek"},
        "budget": {"name": "low"}, "system": SYSTEMS[system], "dataset": {"name": "gsm8k"},
        "hardware": A100, "workload": {}, "spec": {"k": K}, "progress": False})
    loaded = load_model(cfg.model, CPU, progress=False)
    # transformers reads its stop set from the model's generation config at each request
    loaded.model.generation_config.eos_token_id = sorted(stop) or None
    budget = resolve_slots(cfg.budget, cfg.model, loaded.spec.num_experts, loaded.spec.top_k)
    budget = dataclasses.replace(budget, staging=0)
    engine = build_engine(job_of(cfg, loaded, budget, CPU))
    if hasattr(engine, "stop"):
        engine.stop = set(stop)
    if system == "resident_compiled":
        assert engine.static is not None, engine.compiled
    return engine, loaded


def _since_start(gen) -> list[float]:
    return [t - gen.start_time_s for t in gen.commit_times_s]


def listen(engine, ids: list[int], n: int):
    """One request with a listener: its Generation and the chunks it heard."""
    chunks: list[list[int]] = []
    engine.reset()
    gen = engine.generate(ids, n, on_commit=lambda tokens: chunks.append(list(tokens)))
    return gen, chunks


@pytest.fixture(scope="module")
def case():
    """The prompt, resident's free-running output, and a stop token that first appears inside
    the second speculative window (so the window is cut at it)."""
    engine, loaded = build("resident", set())
    ids = loaded.tokenizer(PROMPTS[1])["input_ids"][:12]
    ref = engine.generate(ids, N_NEW).tokens
    assert len(ref) == N_NEW
    first = {}
    for p, tok in enumerate(ref):
        first.setdefault(tok, p)
    # windows of K + 1 tokens after the prefill's: p = 1..4, 5..8, ...; prefer mid-window
    firsts = sorted(first.items(), key=lambda kv: (kv[1] % (K + 1) not in (2, 3), kv[1] < K + 2,
                                                   kv[1]))
    stop, at = firsts[0]
    assert at > 0, f"premise: resident's output repeats its first token only: {ref}"
    return ids, ref, stop, at


def steer(system, monkeypatch, loaded, ids, ref, plan):
    """Specter's proposals as `plan` makes them (steering.py: window w is wrong at step
    `plan(w)`, None: every proposal right), whatever the weights."""
    if system == "specter":
        steered_draft(monkeypatch, [ids], [ref], loaded.model.config.vocab_size,
                      lambda b, w: plan(w))


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_the_listener_hears_exactly_the_committed_tokens(system, case, monkeypatch):
    ids, ref, _, _ = case
    engine, loaded = build(system, set())
    steer(system, monkeypatch, loaded, ids, ref, lambda w: 1 if w % 2 else None)  # K, 1, K ...
    engine.reset()
    quiet = engine.generate(ids, N_NEW)  # no listener: as before
    gen, chunks = listen(engine, ids, N_NEW)
    assert sum(chunks, []) == gen.tokens == quiet.tokens == ref
    # the listener costs no clock time (each request's times from its own start)
    assert _since_start(gen) == pytest.approx(_since_start(quiet), rel=1e-9, abs=1e-12)
    assert all(chunks), chunks
    if system != "specter":  # one token per greedy step (generate's too)
        assert [len(c) for c in chunks] == [1] * N_NEW
        return
    # the prefill's token, then per window its accepted proposals and the target's token
    accepted = gen.stats["accepted_lens"]
    assert [len(c) for c in chunks] == [1] + [a + 1 for a in accepted]
    assert max(len(c) for c in chunks) == K + 1 and 2 in [len(c) for c in chunks]


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_the_stream_ends_at_the_stop_token_and_at_the_limit(system, case, monkeypatch):
    ids, ref, stop, at = case
    engine, loaded = build(system, {stop})
    steer(system, monkeypatch, loaded, ids, ref, lambda w: None)  # every window accepts K
    gen, chunks = listen(engine, ids, N_NEW)
    assert sum(chunks, []) == gen.tokens == ref[:at + 1]  # the stop token included, last
    if system == "specter" and at % (K + 1) in (2, 3):  # the stop falls inside a window:
        assert len(chunks[-1]) == (at - 1) % (K + 1) + 1  # its chunk is cut after it
    # max_new_tokens: with K = 3 the speculative request commits 1 + 4, then 1 (its quota)
    engine.stop = set()
    if system == "transformers":
        engine.model.generation_config.eos_token_id = None
    gen, chunks = listen(engine, ids, 6)
    assert sum(chunks, []) == gen.tokens == ref[:6]


@pytest.mark.parametrize("system", ["resident", "lru", "specter"])
def test_a_batch_takes_a_limit_per_request_and_a_listener_can_end_its_request(system, case):
    """`generate_batch(prompts, [limits], on_commit=[...])` (the server's batches, issue 58):
    each request stops at its own limit; a listener that returns False (its client went
    away) ends its request at that commit, and the other request decodes exactly as alone."""
    ids, ref, _, _ = case
    engine, loaded = build(system, set())
    other = loaded.tokenizer(PROMPTS[2])["input_ids"][:9]
    engine.reset()
    alone = engine.generate(other, N_NEW).tokens
    heard: list[list[int]] = [[], []]

    def gone_after_two(tokens):
        heard[0] += tokens
        return len(heard[0]) < 2  # the client leaves once it holds two tokens

    engine.reset()
    gens = engine.generate_batch([ids, other], [N_NEW, 5],
                                 on_commit=[gone_after_two, lambda t: heard[1].extend(t)])
    assert gens[1].tokens == alone[:5] == heard[1]  # its own limit, its own tokens
    assert gens[0].tokens == heard[0] == ref[:len(heard[0])]  # ended where it said so
    assert 2 <= len(gens[0].tokens) < N_NEW
