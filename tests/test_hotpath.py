"""The hot-path counter (experiments/hotpath.py): it sees what decoding dispatches, phase by
phase, the same counts on every run, and none of the host work that only charges a modelled
clock."""

from __future__ import annotations

import pytest

from experiments import hotpath, records

# the eager draft step's operations (spec.compile=off); the compiled step's: the last test
SMALL = ["model=tiny_deepseek", "workload.items=1", "workload.max_new_tokens=12",
         "workload.stop_on_eos=false", "spec.k=4", "spec.compile=off"]


def _by(rows, system, phase):
    return next(r for r in rows if r["system"] == system and r["phase"] == phase)


@pytest.fixture(scope="module")
def counted(tmp_path_factory, tiny_models):
    tiny_models("tiny_deepseek")  # built once for the session
    out = tmp_path_factory.mktemp("hot")
    return hotpath.measure(["resident", "specter"], SMALL, out, log=lambda *_: None), out


def test_each_phase_is_counted_and_the_counts_repeat(counted, tmp_path):
    rows, _ = counted
    res, spec = _by(rows, "resident", "decode"), _by(rows, "specter", "verify")
    assert res["forwards"] == 11 and res["committed_tokens"] == 11  # 12 tokens, the first from prefill
    assert _by(rows, "resident", "draft")["ops"] == 0
    assert spec["forwards"] > 0 and _by(rows, "specter", "draft")["forwards"] > spec["forwards"]
    for r in (res, spec, _by(rows, "specter", "draft")):
        assert 0 < r["launching"] < r["ops"] and r["host_side"] > 0  # the batch cache's mask
    assert spec["host_reads"] > 0  # the routing, once per MoE layer
    assert _by(rows, "resident", "bookkeeping")["host_reads"] == 12  # each of 12 tokens, once
    total = _by(rows, "specter", "decoding (all but prefill)")
    assert total["ops"] == sum(_by(rows, "specter", p)["ops"]
                               for p in ("decode", "draft", "verify", "bookkeeping"))
    again = hotpath.measure(["specter"], SMALL, tmp_path, log=lambda *_: None)
    assert [(r["phase"], r["ops"], r["syncs"], r["host_reads"]) for r in again] == \
        [(r["phase"], r["ops"], r["syncs"], r["host_reads"]) for r in rows
         if r["system"] == "specter"]


def test_charging_a_modelled_clock_is_not_counted(counted, tmp_path):
    """Resident decoded on the CPU's own clock (nothing charged) and on the A100's virtual
    clock (its experts priced from the router's choice, a host read per layer): the same
    counts, since a real engine would not issue that read."""
    rows, _ = counted
    wall = hotpath.measure(["resident"], [*SMALL, "hardware=cpu", "system.compile=off"], tmp_path,
                           log=lambda *_: None)
    for phase in ("prefill", "decode", "bookkeeping"):
        a, b = _by(rows, "resident", phase), _by(wall, "resident", phase)
        assert (a["ops"], a["syncs"], a["host_reads"]) == (b["ops"], b["syncs"], b["host_reads"])


def test_verification_reads_the_routing_once_per_moe_layer(counted, tiny_models, tmp_path):
    """The shared runtime's budget (issue 25, item 2): per verification forward, and per
    offloaded decode forward of lru, no more device-waiting operations than resident's own
    forward issues, and one host read of the routing per MoE layer (plus, for the
    verification, the one read of the target's tokens that acceptance needs)."""
    rows, _ = counted
    moe_layers = tiny_models("tiny_deepseek").spec.num_moe_layers
    lru = hotpath.measure(["lru"], SMALL, tmp_path, log=lambda *_: None)
    res = _by(rows, "resident", "decode")
    per_forward = lambda r, col: r[col] / r["forwards"]  # noqa: E731
    for r, extra_reads in ((_by(lru, "lru", "decode"), 0), (_by(rows, "specter", "verify"), 1)):
        assert per_forward(r, "syncs") <= per_forward(res, "syncs"), r
        assert per_forward(r, "host_reads") <= moe_layers + extra_reads, r


def test_the_fused_draft_kernels_routing_never_reads_the_device():
    """The Triton draft's block alignment (issue 25, item 1): no sync and no host read, and
    the same shapes whatever the routing (so a draft step can be captured and replayed)."""
    import torch

    from specter.quant import kernels

    g = torch.Generator().manual_seed(0)
    shapes = set()
    for _ in range(3):
        idx = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(4)])
        with hotpath.OpCounter() as counter:
            rows, experts = kernels.align_blocks(idx, 16, 64)
        c = counter.counts["bookkeeping"]
        assert c["syncs"] == 0 and c["host_reads"] == 0 and c["ops"] > 0, c
        shapes.add((tuple(rows.shape), tuple(experts.shape)))
    assert len(shapes) == 1


def test_greedy_draft_keeps_its_choices_on_the_device(tiny_models):
    """`draft_steps(on_device=True)` proposes what the host path proposes, stop tokens
    included (cut after the first), for rows of unequal quotas, and reads the device once per
    window instead of once per step."""
    import torch

    from specter.decoding.loop import draft_steps
    from specter.decoding.batch import BatchCache
    from specter.decoding.loop import Events

    lm = tiny_models("tiny_deepseek")
    prompts = [lm.tokenizer(t)["input_ids"][:8] for t in ("def f(x):", "The cat sat on")]

    def run(on_device, stop, k_effs):
        kv = BatchCache(lm.model, torch.device("cpu"), len(prompts))
        logits = kv.forward([list(p) for p in prompts])
        feeds = [[int(logits[r, -1].argmax())] for r in range(len(prompts))]
        with torch.no_grad(), hotpath.OpCounter() as counter:
            out = [[] for _ in feeds]
            for _ in draft_steps(kv, feeds, k_effs, lambda r, row: int(row.argmax()),
                                 stop, out, Events(), on_device=on_device):
                pass
        return out, counter.counts["bookkeeping"]["host_reads"], counter.counts["bookkeeping"]

    plain, _, _ = run(False, set(), [5, 3])
    stop = {plain[0][1]}  # row 0 drafts a stop token at its second step
    want, _, host_counts = run(False, stop, [5, 3])
    got, reads, dev_counts = run(True, stop, [5, 3])
    assert got == want and want[0] == plain[0][:2] and len(want[1]) <= 3
    assert reads == 1  # the window's one read of its proposals
    assert dev_counts["syncs"] < host_counts["syncs"]


def test_a_greedy_draft_step_never_waits_for_the_host(counted):
    """issue 25 item 1, the budget per phase: Specter's draft steps (the fixed-shape
    gather_int4 backend, the greedy choice kept on the device) read nothing from the device
    and sync only to upload each window's first input (the token acceptance chose on the
    host); the window's reads are bookkeeping: its proposals once, acceptance once, the ELB
    once per plan (how many plans a window makes depends on the routing and the clock: the
    record says)."""
    rows, out = counted
    draft, book = _by(rows, "specter", "draft"), _by(rows, "specter", "bookkeeping")
    windows = _by(rows, "specter", "verify")["forwards"]
    assert draft["forwards"] > windows and draft["host_reads"] == 0, draft
    assert draft["syncs"] <= windows, draft  # at most one upload per window, none per step
    rec = records.load(out / "records" / "specter")
    plans = round(float((rec["plan_boundaries_per_window"] * rec["windows"]).sum()))
    assert 0 < plans <= draft["forwards"]
    assert book["syncs"] + book["host_reads"] <= 2 * windows + plans, (book, plans)


def test_the_default_draft_issues_no_more_than_residents_decode(tmp_path):
    """issue 36 item 6: with the default settings (spec.compile=auto; the counter's
    gather_int4, the fixed-shape backend whose operations are a GPU's), Specter's draft step
    is one compiled graph, and per committed token Specter issues at most 1.1x resident's
    launching operations and no more host waits (syncs and reads). The graph is checked by
    the eager backend here (inductor's code would be counted the same: one replay per step)."""
    common = ["model=tiny_deepseek", "workload.items=1", "workload.max_new_tokens=24",
              "workload.stop_on_eos=false", "spec.compile_backend=eager"]
    rows = hotpath.measure(["resident", "specter"], common, tmp_path, log=lambda *_: None)
    res, spec = (_by(rows, s, "decoding (all but prefill)") for s in ("resident", "specter"))
    assert _by(rows, "specter", "draft")["graph_replays"] > 0
    assert spec["launching_per_token"] <= 1.1 * res["launching_per_token"], (spec, res)
    waits = lambda r: r["syncs_per_token"] + r["host_reads_per_token"]  # noqa: E731
    assert waits(spec) <= waits(res), (spec, res)
    rec = records.load(tmp_path / "records" / "specter")
    assert rec["draft_compiled"].all() and (rec["draft_compile"] == "spec.compile=auto").all()
