"""Issue 45 items 4 and 7: a window's device work, counted on the CPU with teeth.

Verification computes a MoE layer's routed experts in rounds of one fixed-launch kernel each
(specter/offload/grouped.py): the launches per MoE layer do not grow with the experts a window
needs, one host read per layer, no sync; a draft step is one graph replay; a window's host
waits are at most 2 plus 1 per MoE layer (and the orchestrator's plan reads). The counts depend
on the routing's shape (tokens x top-k over E experts, the slots), not on the widths:
tiny_deepseek has DeepSeek-V2-Lite's 64 routed experts, top-6 and 2 shared experts. The bound
is a tenth of the 423 launches per MoE layer per window that the per-expert loop (what CUDA
ran in float16 before) counted at DeepSeek-V2-Lite's widths.
"""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from experiments import hotpath
from specter.counting import OpCounter
from specter.experts import experts_of
from specter.offload import grouped as grouped_mod
from specter.offload import runtime as runtime_mod
from test_offload import make_engine

BOUND = 42  # launching operations per MoE layer per window, copies apart: 423 / 10


def _count_layers(engine, ids):
    """Per experts_forward call: (launching - copies, copies, syncs, host reads, rounds,
    experts needed)."""
    rounds = []
    real = runtime_mod.grouped_products

    def counted_products(*a, **k):
        rounds[-1] += 1
        return real(*a, **k)

    counter, rows = OpCounter(), []
    seat = experts_of(engine.model)  # the dispatcher's target seat: the runtime's
    inner = seat.target

    def per_layer(*a, **k):
        before = dict(counter.counts["moe"])
        rounds.append(0)
        counter.phase = "moe"
        try:
            return inner(*a, **k)
        finally:
            counter.phase = "rest"
            now = counter.counts["moe"]
            d = {c: now.get(c, 0) - before.get(c, 0) for c in ("launching", "copies", "syncs",
                                                               "host_reads")}
            rows.append((d["launching"] - d["copies"], d["copies"], d["syncs"], d["host_reads"],
                         rounds[-1], engine.runtime.stats.forward_distinct[-1]))

    seat.target = per_layer
    runtime_mod.grouped_products = counted_products
    try:
        engine.reset()
        with torch.no_grad(), counter:
            engine.model(input_ids=ids)
    finally:
        runtime_mod.grouped_products = real
        seat.target = inner
    return rows


KERNEL_OF = {"auto": "fused", True: "grouped_mm", "padded": "padded"}


@pytest.mark.parametrize("kernel", ["auto", True, "padded"])
def test_a_moe_layer_launches_a_fixed_count_whatever_the_experts_it_needs(kernel, tiny_models):
    """A 17-token window (K=16) and a 3-token one at every slot: the same launches per MoE
    layer, at most BOUND, though the window needs several times the experts; one host read, no
    sync. The per-expert loop's count grows with the experts (and is above BOUND)."""
    lm = tiny_models("tiny_deepseek")
    tokens = lm.tokenizer(PROMPTS[1])["input_ids"]
    grouped, _ = make_engine("tiny_deepseek", "lru", 64, offload={"grouped": kernel})
    loop, _ = make_engine("tiny_deepseek", "lru", 64, offload={"grouped": False})
    assert grouped.runtime.kernel() == KERNEL_OF[kernel]
    seen = {}
    for T in (3, 17):
        ids = torch.tensor([tokens[:T]])
        rows = _count_layers(grouped, ids)
        assert all(r[1:5] == (0, 0, 1, 1) for r in rows), rows  # no copy or sync, 1 read, 1 round
        seen[T] = [r[0] for r in rows]
        assert max(seen[T]) <= BOUND, rows
        looped = _count_layers(loop, ids)
        needed = [r[5] for r in looped]
        assert [r[0] for r in looped] > [BOUND] * len(looped) or T == 3, looped
    assert seen[3] == seen[17]
    assert needed != [r[5] for r in _count_layers(loop, torch.tensor([tokens[:3]]))]
    if kernel == "auto":  # a round: the indices' upload and the op's two launches
        unfused, _ = make_engine("tiny_deepseek", "lru", 64, offload={"grouped": True})
        rows = _count_layers(unfused, torch.tensor([tokens[:17]]))
        assert [r[0] - 7 for r in rows] == seen[17], (rows, seen)


def test_the_fused_round_is_the_grouped_round_to_the_bit(tiny_models):
    """On the CPU the fused round's op runs `grouped_mm`'s arithmetic: a 17-token forward
    streaming through 8 slots gives the same logits to the bit, fused or not."""
    lm = tiny_models("tiny_deepseek")
    ids = torch.tensor([lm.tokenizer(PROMPTS[0])["input_ids"][:17]])
    logits = {}
    for grouped in ("auto", True):
        engine, _ = make_engine("tiny_deepseek", "lru", 8, offload={"grouped": grouped})
        engine.reset()
        with torch.no_grad():
            logits[grouped] = engine.model(input_ids=ids).logits
    assert torch.equal(logits["auto"], logits[True])


def test_streaming_through_few_slots_costs_rounds_not_experts(tiny_models):
    """At 8 and 16 of 64 slots a 17-token window streams most of its experts through the
    slots: the copies are the misses, each issued once; the launches are a fixed part plus a
    fixed part per round, and the rounds are bounded by the chunks and the refills of the
    slots, not one per expert."""
    lm = tiny_models("tiny_deepseek")
    ids = torch.tensor([lm.tokenizer(PROMPTS[1])["input_ids"][:17]])
    for slots in (8, 16):
        engine, _ = make_engine("tiny_deepseek", "lru", slots)
        for launching, copies, syncs, reads, rounds, needed in _count_layers(engine, ids):
            assert syncs == 0 and reads == 1
            assert copies <= needed
            # per fill of the slots: what had landed, then the copies in MISS_ROUNDS chunks
            bound = (runtime_mod.Rounds.MISS_ROUNDS + 1) * -(-needed // slots)
            assert rounds <= bound and 2 * rounds <= needed, (slots, needed, rounds)
            assert launching <= 24 + 10 * rounds, (slots, launching, rounds)


def test_cuda_computes_resident_experts_in_a_fixed_launch_kernel_in_every_dtype():
    """The fused round (`specter::expert_round`) wherever it runs. Without it: torch's grouped
    GEMM runs on CUDA without a host sync only in bfloat16 on compute capability 9.x/10.x;
    elsewhere (float16, an A100) the padded kernel: never the per-expert loop."""
    cuda, pick = torch.device("cuda"), grouped_mod.pick_kernel
    # the fused round wherever it runs: the CPU (its torch body), CUDA with Triton
    assert pick(torch.device("cpu"), torch.float32) == "fused"
    for dtype, cap in ((torch.bfloat16, (9, 0)), (torch.float16, (8, 0)), (torch.float32, (10, 0))):
        assert pick(cuda, dtype, cap, fused=True) == "fused"
    # else the unfused kernels
    assert pick(torch.device("cpu"), torch.float32, fused=False) == "grouped_mm"
    assert pick(cuda, torch.bfloat16, (9, 0), fused=False) == "grouped_mm"
    assert pick(cuda, torch.float16, (9, 0), fused=False) == "padded"
    assert pick(cuda, torch.bfloat16, (8, 0), fused=False) == "padded"
    assert pick(cuda, torch.float32, (10, 0), fused=False) == "padded"


def test_a_window_is_one_replay_per_draft_step_and_a_few_host_waits(tmp_path, tiny_models):
    """Specter with the defaults (the draft step compiled; the eager backend checks the graph
    here, as inductor's would be counted: one replay per step): each draft step one launching
    operation and no host wait; the verification's inputs uploaded without a wait and one read
    per MoE layer; per window at most 2 host waits (its proposals, its acceptance) plus 1 per
    MoE layer, plus one per planning boundary (the orchestrator reads its lookahead buffer
    there: the paper's design), plus the request's first token. The launches per MoE layer:
    at most BOUND plus two more rounds (copies apart) when misses stream in."""
    from experiments import records

    moe_layers = tiny_models("tiny_deepseek").spec.num_moe_layers
    common = ["model=tiny_deepseek", "workload.items=1", "workload.max_new_tokens=40",
              "workload.stop_on_eos=false", "spec.k=16", "spec.compile_backend=eager"]
    rows = hotpath.measure(["specter"], common, tmp_path, log=lambda *_: None)
    by = {r["phase"]: r for r in rows}
    draft, verify = by["draft"], by["verify"]
    assert draft["launching"] == draft["forwards"] == draft["graph_replays"] > 0, draft
    windows = verify["forwards"]
    rec = records.load(tmp_path / "records" / "specter")
    plans = round(float((rec["plan_boundaries_per_window"] * rec["windows"]).sum()))
    waits = sum(by[p]["syncs"] + by[p]["host_reads"] for p in ("draft", "verify", "bookkeeping"))
    # + 1: the request's first token, picked from the prefill's logits
    assert waits <= windows * (2 + moe_layers) + plans + 1, (by, plans)
    assert verify["syncs"] == 0 and verify["host_reads"] == windows * moe_layers, verify
    assert draft["syncs"] == draft["host_reads"] == 0, draft
    assert verify["experts_calls"] == windows * moe_layers
    assert verify["experts_launching"] / verify["experts_calls"] <= BOUND + 2 * 10, verify


def test_a_gpu_runs_a_bfloat16_checkpoint_in_bfloat16(tmp_path):
    """model.dtype=auto: the checkpoint's bfloat16 on a GPU that computes it (so the grouped
    kernel is torch's on an H100/H200), float16 otherwise, float32 on the CPU."""
    import json

    from specter.config import ModelConfig
    from specter.models.loading import pick_dtype

    auto = ModelConfig(name="x", source="hf", dtype="auto")
    cuda = torch.device("cuda")
    for shipped, bf16_ok, want in (("bfloat16", True, torch.bfloat16),
                                   ("bfloat16", False, torch.float16),
                                   ("float32", True, torch.float16)):
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": shipped}))
        assert pick_dtype(auto, cuda, tmp_path, bf16_ok=bf16_ok) == want
    assert pick_dtype(auto, torch.device("cpu"), tmp_path) == torch.float32
    fp16 = ModelConfig(name="x", source="hf", dtype="float16")
    assert pick_dtype(fp16, cuda, tmp_path) == torch.float16
