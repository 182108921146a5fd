"""Resident experts as grouped GEMMs (specter/offload/grouped.py): bitwise the per-expert
loop's outputs at every budget (streaming through the slots included), fewer launches, and the
switch."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from specter.config import RunConfig
from specter.counting import OpCounter
from specter.errors import UserError
from test_offload import A100, decode_all, make_engine


def _logits(engine, ids):
    engine.reset()
    with torch.no_grad():
        return engine.model(input_ids=ids).logits


@pytest.mark.parametrize("name", ["tiny_deepseek", "tiny_phi"])
def test_grouped_experts_are_bitwise_the_per_expert_loop(name):
    """A 16-token forward at k slots (misses stream through the slots), half the experts, and
    all of them: the same logits to the bit, grouped or not; decoding gives the same tokens."""
    _, loaded = make_engine(name, "resident", None)
    e, k = loaded.spec.num_experts, loaded.spec.top_k
    ids = torch.tensor([loaded.tokenizer(PROMPTS[0])["input_ids"][:16]])
    for slots in sorted({k, (k + e) // 2, e}):
        grouped, _ = make_engine(name, "lru", slots)
        loop, _ = make_engine(name, "lru", slots, offload={"grouped": False})
        assert grouped.runtime.grouping() and not loop.runtime.grouping()
        assert torch.equal(_logits(grouped, ids), _logits(loop, ids)), f"{name} at {slots} slots"
        a = [g.tokens for g in decode_all(grouped, loaded.tokenizer, n=8)]
        b = [g.tokens for g in decode_all(loop, loaded.tokenizer, n=8)]
        assert a == b


def test_grouped_experts_launch_fewer_kernels_and_are_charged_as_one_call():
    _, loaded = make_engine("tiny_deepseek", "resident", None)
    e = loaded.spec.num_experts
    ids = torch.tensor([loaded.tokenizer(PROMPTS[1])["input_ids"][:16]])
    launches, seconds = {}, {}
    for grouped in (True, False):
        engine, _ = make_engine("tiny_deepseek", "lru", e, offload={"grouped": grouped})
        engine.reset()
        counter = OpCounter()
        with torch.no_grad(), counter:
            engine.model(input_ids=ids)
        launches[grouped] = counter.counts["bookkeeping"]["launching"]
        seconds[grouped] = engine.timing.link.now()
        assert counter.counts["bookkeeping"]["syncs"] == 0
    assert launches[True] < launches[False] / 2, launches
    # the clock follows the engine: a layer's experts in one kernel call cost less than one
    # eager call each (costmodel.grouped_experts_s against expert_s per expert)
    assert seconds[True] < seconds[False]


def test_grouped_with_staging_buffers_is_lossless():
    resident, loaded = make_engine("tiny_qwen", "resident", None)
    ref = [g.tokens for g in decode_all(resident, loaded.tokenizer, n=12)]
    specter, _ = make_engine("tiny_qwen", "specter", loaded.spec.top_k, spec={"k": 4}, staging=4)
    gens = decode_all(specter, loaded.tokenizer, n=12)
    assert [g.tokens for g in gens] == ref
    assert gens[0].stats["grouped_experts"] is True


def test_offload_grouped_takes_auto_true_or_false():
    base = {"model": {"name": "tiny_qwen", "source": "project"}, "budget": {"name": "high"},
            "system": {"name": "lru"}, "dataset": {"name": "gsm8k"}, "workload": {}, "hardware": A100}
    for ok in ("auto", True, False):
        RunConfig.from_dict({**base, "offload": {"grouped": ok}}).validate()
    with pytest.raises(UserError, match="offload.grouped"):
        RunConfig.from_dict({**base, "offload": {"grouped": "sometimes"}}).validate()
