"""The draft step as one compiled graph over a static draft cache (specter/decoding/compiled_draft.py).

torch.compile(fullgraph=True) raises on any graph break, host read or data-dependent shape:
the conditions a CUDA graph capture needs, checked by the compiler on the CPU. The tests
compile with the "eager" backend (dynamo's graph, no code generation: seconds, not minutes);
the benchmark (scripts/bench_compile.sh, experiments/compile_table.py) times inductor's code.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, hf_greedy, run_cli
from specter.config import HardwareConfig, ModelConfig
from specter.settings import run_config
from specter.decoding.draft import speculative_greedy
from specter.decoding.loop import Events
from specter.decoding.draft_mode import DraftMode
from specter.decoding.compiled_draft import StaticKV
from specter.quant.step_form import draft_step_form
from specter.decoding.batch import DeviceMemory, eos_ids
from specter.errors import UserError
from specter.clock.kinds import CUDA
from specter.clock.timing import Timing
from specter.placement.loader import load_model
from specter.quant import calibrate

CPU = torch.device("cpu")
PROMPT = "The committee met on Tuesday to discuss the budget, and after a long debate"


def _setup(name: str, noise: float = 0.0):
    """A model and its INT4 self-draft (gather_int4: the backend that compiles whole);
    `noise` scales every quantization scale by a random factor in [1 - noise, 1 + noise], a
    worse draft whose proposals get rejected."""
    lm = load_model(ModelConfig(name=name, source="project", dtype="float32"), CPU, progress=False)
    qe = calibrate.quantize_experts(lm.model, calibrate.QuantSpec(method="rtn", bits=4, group=32),
                                    None, CPU)
    g = torch.Generator().manual_seed(0)
    for layer in qe.gate_up + qe.down:
        for qm in layer:
            qm.scales.mul_(1 + noise * (2 * torch.rand(qm.scales.shape, generator=g) - 1))
    return lm, DraftMode(lm.model, qe, backend="gather_int4")


def _run(lm, sw, ids, n, k, layout=None):
    return speculative_greedy(lm.model, sw, ids, n, k, CPU, Timing.wall(CPU).link,
                              eos_ids(lm.model), DeviceMemory(lm.model, CPU), layout=layout)


_hf = hf_greedy


@pytest.mark.parametrize("name", TINY)
def test_a_compiled_draft_step_is_lossless_on_every_architecture(name):
    """Tokens equal plain `generate` with the draft step compiled whole (fullgraph: a graph
    break would raise), at several depths; one compilation serves every window and request."""
    lm, sw = _setup(name)
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    ref = _hf(lm.model, ids, 20)
    static = StaticKV(sw, compiler="eager")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for k in (1, 3, 6):
        assert _run(lm, sw, ids, 20, k, static).tokens == ref, (name, k)
    assert static.steps_run > 0
    # one graph: every step of every window and request reused it
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.parametrize("name", ["tiny_deepseek", "tiny_qwen"])
def test_the_compiled_draft_proposes_what_the_eager_draft_proposes(name):
    """A noisy draft so that proposals get rejected: the static cache holds the target's KV of the
    committed tokens (copied in each window), so the draft proposes the same tokens as the
    eager draft over the target's own cache, window by window."""
    lm, sw = _setup(name, noise=0.9)
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    eager = _run(lm, sw, ids, 24, 4)
    compiled = _run(lm, sw, ids, 24, 4, StaticKV(sw, compiler="eager"))
    assert compiled.tokens == eager.tokens
    assert compiled.stats["accepted_lens"] == eager.stats["accepted_lens"]
    assert min(eager.stats["accepted_lens"]) < 4  # rejections happened


def test_a_host_read_inside_the_draft_step_is_a_graph_break_and_fails(monkeypatch):
    """The check can fail: a draft expert that reads the routing on the host (as cpu_int4
    does) breaks the graph, and fullgraph refuses it."""
    lm, sw = _setup("tiny_deepseek")
    layer = sw.draft_layers[0]
    original = type(layer).__call__

    def reads_host(self, hidden, top_k_index, top_k_weights):
        if int(top_k_index.max()) < 0:  # a host read of a device value
            return hidden
        return original(self, hidden, top_k_index, top_k_weights)

    monkeypatch.setattr(type(layer), "__call__", reads_host)
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    with pytest.raises(Exception, match="(?i)graph break|data-dependent|Unsupported|item"):
        _run(lm, sw, ids, 8, 3, StaticKV(sw, compiler="eager"))


def test_listeners_hear_every_draft_layer_after_a_compiled_step():
    """Routing listeners (the clock's charge, the lookahead buffer) do not run inside the
    graph; they hear each layer's routing after the step, in layer order, as eagerly."""
    lm, sw = _setup("tiny_qwen")
    heard: list[tuple[int, list[int]]] = []
    sw.draft_listeners.append(lambda l, t: heard.append((l, t.flatten().tolist())))
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    _run(lm, sw, ids, 12, 4)
    eager = list(heard)
    heard.clear()
    _run(lm, sw, ids, 12, 4, StaticKV(sw, compiler="eager"))
    assert heard == eager and len(eager) > 0


def test_an_every_layer_listener_hears_a_compiled_step_once_and_counts_as_eagerly():
    """After a compiled step the lookahead buffer counts every layer in one call (one launch,
    not one per MoE layer), to the same counts as the eager draft's layer-by-layer adds; the
    virtual clock's every-layer charge charges what its per-layer form charges."""
    from types import SimpleNamespace

    from specter.decoding.draft import draft_experts_charge
    from specter.pio.elb import ExpertLookaheadBuffer

    lm, sw = _setup("tiny_qwen")
    layers, experts = len(sw.draft_layers), lm.model.config.num_experts
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    eager, compiled = (ExpertLookaheadBuffer(layers, experts, CPU) for _ in range(2))
    heard: list = []
    sw.listen(eager.add)
    _run(lm, sw, ids, 12, 4)
    sw.draft_listeners.clear()
    sw.listen(compiled.add, lambda routes: (heard.append(routes.tolist()), compiled.add_all(routes)))
    _run(lm, sw, ids, 12, 4, StaticKV(sw, compiler="eager"))
    assert torch.equal(eager.counts, compiled.counts) and eager.counts.sum() > 0
    steps = len(heard)
    assert steps > 0 and all(len(r) == layers for r in heard)  # one call per step, every layer

    charged: list = []
    from specter.clock.observer import ComputeClock

    link = SimpleNamespace(compute=charged.append)
    cost = SimpleNamespace(router_s=lambda t: ("router", t),
                           draft_experts_s=lambda n, b, g, dequantized: ("experts", tuple(n)))
    timing = SimpleNamespace(observer=lambda model, charge_experts: ComputeClock(link, cost))
    per_layer, all_layers = draft_experts_charge(
        timing, SimpleNamespace(experts=SimpleNamespace(spec=SimpleNamespace(bits=4, group=32)),
                                backend="gather_int4"))
    for routes in heard:
        for layer, top_k in enumerate(torch.tensor(routes).unbind(0)):
            per_layer(layer, top_k)
    one_by_one, charged[:] = list(charged), []
    for routes in heard:
        all_layers(torch.tensor(routes))
    assert charged == one_by_one and len(charged) == 2 * layers * steps


def resolve_compile(setting, backend, rows, sampling):
    """draft_step_form's answer for a CPU job (the step compiled, and why)."""
    from types import SimpleNamespace as NS

    job = NS(draft=NS(compile=setting, quant=NS(graphs="auto")), rows=rows,
             temperature=0.7 if sampling else 0.0, device=CPU)
    form = draft_step_form(job, backend)
    return form.compiled, form.why


def test_the_step_form_says_why_and_refuses_on_in_one_sentence():
    assert resolve_compile("off", "gather_int4", 1, False) == (False, "spec.compile=off")
    assert resolve_compile("auto", "gather_int4", 1, False)[0]
    on, why = resolve_compile("auto", "cpu_int4", 4, False)
    assert not on and "batch of 4" in why and "cpu_int4" in why
    with pytest.raises(UserError, match="spec.compile=on cannot compile"):
        resolve_compile("on", "gather_int4", 1, True)
    with pytest.raises(UserError, match="spec.compile must be one of"):  # checked once, with
        run_config(["spec.compile=yes"]).validate()  # the config (config.validate)
    on, why = resolve_compile("auto", "triton", 1, False)
    assert not on and "per layer as a CUDA graph" in why
    # where it compiles, auto compiles (on CUDA the whole step captured: issue 45 item 3)
    assert resolve_compile("auto", "gather_int4", 1, False) == (True, "spec.compile=auto")
    on, why = resolve_compile("auto", "gather_int4", 2, False)
    assert not on and "batch of 2" in why


def test_the_default_backend_serves_a_compiled_step_where_auto_compiles():
    """quant.backend=auto takes fused_int4 on CUDA, gather_int4 on the CPU (backends whose
    step compiles whole) where spec.compile asks for a compiled step: auto on the CPU's own
    clock, one greedy row, or on;
    on a virtual clock, a batch or sampling it keeps cpu_int4 (eager, and says why)."""
    from types import SimpleNamespace as NS

    from specter.quant.build import resolve_backend

    def draft_compiles(job):  # the question before the backend
        return draft_step_form(job).compiled

    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def wants(clock="wall", compile="auto", batch=1, temperature=0.0, device=cpu, host_op_s=0.0):
        job = NS(clock=NS(hardware=HardwareConfig("t", clock=clock, host_op_s=host_op_s)),
                 draft=NS(compile=compile, quant=NS(graphs="auto")), rows=batch,
                 temperature=temperature, device=device)
        return draft_compiles(job)

    assert wants() and wants(clock="virtual", compile="on") and wants(device=cuda, compile="on")
    assert not wants(clock="virtual") and not wants(batch=4) and not wants(temperature=0.7)
    # a counted profile's virtual clock charges the GPU's engine: its step compiled (issue 46)
    assert wants(clock="virtual", host_op_s=2e-5)
    assert not wants(clock="virtual", host_op_s=2e-5, batch=4)
    assert not wants(compile="off")
    # CUDA, a real clock: auto captures the whole step, so the backend is gather_int4 ...
    assert wants(device=cuda) and not wants(device=cuda, clock="virtual")
    # ... unless quant.graphs=on asked for each draft layer's own graph
    on_graphs = NS(clock=NS(hardware=HardwareConfig("t", clock="wall")),
                   draft=NS(compile="auto", quant=NS(graphs="on")), rows=1, temperature=0.0,
                   device=cuda)
    assert not draft_compiles(on_graphs)
    # fused_int4 on CUDA (its fused INT4 kernels inside one custom op); gather_int4 on the CPU
    # (inductor fuses its dequantization there, fused_int4's CPU body is eager) and on CUDA
    # without triton
    assert resolve_backend("auto", 4, cpu, {32}, compiles=True)[0] == "gather_int4"
    from specter.quant.kernels import triton_available
    assert resolve_backend("auto", 4, cuda, {32}, compiles=True)[0] == (
        "fused_int4" if triton_available() else "gather_int4")
    # a counted profile on the CPU keeps gather_int4 (the operations it charges)
    assert resolve_backend("auto", 4, cpu, {32}, counted=True, compiles=True)[0] == "gather_int4"
    assert resolve_backend("cpu_int4", 4, cpu, {32}, compiles=True)[0] == "cpu_int4"


def test_compiled_runs_through_the_runner_record_it_and_charge_a_captured_step(tmp_path):
    """spec.compile=on through run.py: the same tokens as off, the rows say the step ran
    compiled over a static cache, and the virtual clock charges the same forwards (hooks
    replayed after the step) as a captured graph's replay (no per-kernel launch or eager
    framework cost inside it, one launch a step), plus each window's copy of committed KV."""
    import pandas as pd

    rows = {}
    for setting in ("off", "on"):
        out = tmp_path / setting
        r = run_cli("model=tiny_deepseek", "system=specter", "hardware=a100_pcie4_hf",
                    "dataset=gsm8k", "workload.items=1", "workload.repeats=1",
                    "workload.max_new_tokens=16", "progress=false", "quant.backend=gather_int4",
                    f"spec.compile={setting}", "spec.compile_backend=eager", f"out_dir={out}")
        assert r.returncode == 0, r.stderr[-2000:]
        rows[setting] = pd.read_parquet(next(out.glob("records/*/*.parquet"))).iloc[0]
    off, on = rows["off"], rows["on"]
    assert list(on["output_tokens"]) == list(off["output_tokens"])
    assert bool(on["draft_compiled"]) and on["draft_kv"] == "static" and on["kv_copies"] > 0
    assert not bool(off["draft_compiled"]) and off["kv_copies"] == 0
    assert bool(on["draft_captured"]) and not bool(off["draft_captured"])
    # the eager profile's launches and framework costs gone from the draft steps: the draft's
    # time falls (so it hides fewer copies: verification may wait longer for its misses)
    assert on["draft_ms_per_window"] < 0.5 * off["draft_ms_per_window"]
    assert on["h2d_bytes"] == off["h2d_bytes"]
    assert on["tpot_ms"] < off["tpot_ms"]
    # the benchmark's table reads these rows: one case each, the compile in its own column
    from experiments.compile_table import table
    from experiments import records

    t = table(pd.concat([records.load(tmp_path / s) for s in ("off", "on")]))
    assert list(t["step"]) == ["eager", "compiled"] and t["compiles"].tolist() == [0, 1]


def test_specmoeoffs_separate_draft_compiles_over_its_own_static_cache(tmp_path, name="tiny_deepseek"):
    """SpecMoEOff's second instance drafts in its own static buffers (the unseen committed
    tokens fed eagerly, each step one graph): the same tokens as eager and as resident, the
    same proposals (acceptance), its own hooks charging each compiled step (as a captured
    graph's replay)."""
    import pandas as pd

    rows = {}
    for system, setting in (("resident", "off"), ("specmoeoff", "off"), ("specmoeoff", "on")):
        out = tmp_path / f"{system}-{setting}"
        r = run_cli(f"model={name}", f"system={system}", "hardware=a100_pcie4_hf",
                    "dataset=gsm8k", "workload.items=1", "workload.repeats=1",
                    "workload.max_new_tokens=16", "progress=false", "quant.backend=gather_int4",
                    f"spec.compile={setting}", "spec.compile_backend=eager", "spec.k=4",
                    f"out_dir={out}")
        assert r.returncode == 0, r.stderr[-2000:]
        rows[(system, setting)] = pd.read_parquet(next(out.glob("records/*/*.parquet"))).iloc[0]
    ref, off, on = rows[("resident", "off")], rows[("specmoeoff", "off")], rows[("specmoeoff", "on")]
    assert list(on["output_tokens"]) == list(off["output_tokens"]) == list(ref["output_tokens"])
    assert bool(on["draft_compiled"]) and on["draft_kv"] == "own" and on["draft_compiles"] == 1
    assert not bool(off["draft_compiled"])
    assert on["acceptance_rate"] == pytest.approx(off["acceptance_rate"])
    # charged by the second instance's own hooks after each step, as a captured graph: the
    # draft's time falls (the window's first step, eager, keeps the eager profile's costs)
    assert bool(on["draft_captured"])
    assert on["draft_ms_per_window"] < off["draft_ms_per_window"]


def test_the_hot_path_counter_counts_a_compiled_step_as_one_graph_replay():
    """Under the operation counter (experiments/hotpath.py) a compiled draft step still runs,
    and counts as one graph replay and one launch, not as the operations inside it."""
    from specter.counting import OpCounter

    lm, sw = _setup("tiny_qwen")
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    static = StaticKV(sw, compiler="eager")
    ref = _run(lm, sw, ids, 12, 4, static).tokens  # compiled outside the counter
    before = static.steps_run
    eager_counter, counter = OpCounter(), OpCounter()
    with eager_counter:
        _run(lm, sw, ids, 12, 4)
    with counter:
        assert _run(lm, sw, ids, 12, 4, static).tokens == ref
    steps = static.steps_run - before
    total = sum((c for c in counter.counts.values()), start=__import__("collections").Counter())
    eager = sum((c for c in eager_counter.counts.values()), start=__import__("collections").Counter())
    assert steps > 0 and total["graph_replays"] == steps
    assert total["launching"] < eager["launching"]  # the steps' operations are one replay each


def test_a_captured_step_is_charged_its_kernels_time_and_one_launch():
    """`ComputeClock.captured_step`: every charge made inside it is priced without per-kernel
    launches or eager framework costs (HardwareProfile.captured), and the block adds one
    launch, the graph's replay; outside it the profile is the eager one again."""
    from types import SimpleNamespace as NS

    from specter.settings import run_config
    from specter.clock.timing import profile_of
    from specter.clock.observer import ComputeClock

    hw = profile_of(run_config(["hardware=a100_pcie4_hf"]).hardware)
    assert hw.launch_overhead_s > 0 and hw.layer_overhead_s > 0 and hw.expert_overhead_s > 0
    charged = []
    charger = ComputeClock.__new__(ComputeClock)  # the block needs only the cost model and the link
    charger.cost, charger.link = NS(hw=hw), NS(compute=charged.append)
    with charger.captured_step():
        inside = charger.cost.hw
        charger.link.compute(1e-3)  # a replayed charge
    assert (inside.launch_overhead_s, inside.layer_overhead_s, inside.expert_overhead_s,
            inside.offload_layer_overhead_s) == (0.0, 0.0, 0.0, 0.0)
    assert inside.matrix_flops == hw.matrix_flops and inside.mem_bandwidth_Bps == hw.mem_bandwidth_Bps
    assert charger.cost.hw is hw and charged == [1e-3, hw.launch_overhead_s]


def test_per_layer_graphs_and_the_captured_step_are_one_or_the_other():
    """quant.graphs=auto leaves the draft layers uncaptured where the whole step is captured
    (spec.compile on CUDA); quant.graphs=on beside spec.compile=on is one sentence; on beside
    auto keeps the per-layer graphs and the step eager, and the record says so."""
    from types import SimpleNamespace as NS

    from specter.decoding.compiled_draft import compiled_mode
    from specter.quant.step_form import GRAPHS_AND_STEP, _layer_graphs as resolve_graphs

    cuda = torch.device("cuda")

    def step_captured(job, backend):  # asked with the backend, before the engine
        return draft_step_form(job, backend).captured

    def job(compile="auto", graphs="auto", batch=1, device=cuda):
        return NS(draft=NS(compile=compile, compile_backend="eager", quant=NS(graphs=graphs)),
                  rows=batch, temperature=0.0, positions=16 + 8, system=NS(name="specter"),
                  device=device)

    assert step_captured(job(), "gather_int4")
    assert not step_captured(job(device=CPU), "gather_int4")
    assert not step_captured(job(), "triton")  # eager: triton's layers graphed instead
    assert not step_captured(job(batch=2), "gather_int4")
    assert not step_captured(job(compile="off"), "gather_int4")
    assert not step_captured(job(graphs="on"), "gather_int4")
    on, why = resolve_graphs("auto", "gather_int4", cuda, whole_step=True)
    assert not on and "whole draft step" in why
    assert resolve_graphs("auto", "triton", cuda, whole_step=False)[0]
    assert resolve_graphs("on", "gather_int4", cuda, whole_step=True)[0]

    graphed = NS(backend="gather_int4", graphs=True)  # an Int4Experts with quant.graphs=on
    with pytest.raises(UserError, match="choose one"):
        compiled_mode(job(compile="on", graphs="on"), graphed, CUDA, 4)
    mode = compiled_mode(job(graphs="on"), graphed, CUDA, 4)
    assert not mode.on and "quant.graphs=on" in mode.record["draft_compile"]
    assert mode.record["draft_graphs"] and mode.static_kv(None) is None
    assert "choose one" in GRAPHS_AND_STEP

    from specter.quant.kernels import capture_graph

    plain = NS(backend="gather_int4", graphs=False)
    mode = compiled_mode(job(), plain, CUDA, 4)
    assert mode.on and mode.capture is capture_graph and mode.positions == 16 + 8 + 4 + 1
    assert mode.record["draft_compiled"] and mode.record["draft_captured"]
    assert "one CUDA graph" in mode.record["draft_compile"]
    # a layout that cannot compile (system.shared=false: a per-window KV copy) under auto:
    # eager, said, and its layers graphed instead (quant.graphs=auto was off for the step)
    mode = compiled_mode(job(), plain, CUDA, 4, copied_kv=True)
    assert not mode.on and "per-window copy" in mode.record["draft_compile"]
    assert mode.graph_layers and "step stays eager" in mode.graph_layers
    assert mode.record["draft_graphs"]
    with pytest.raises(UserError, match="per-window copy"):
        compiled_mode(job(compile="on"), plain, CUDA, 4, copied_kv=True)
    # a draft with no INT4 experts on the device (SpecMoE's host draft): eager, or refused
    assert "no INT4 draft" in compiled_mode(job(), None, CUDA, 4).record["draft_compile"]
    with pytest.raises(UserError, match="compiles an INT4 draft"):
        compiled_mode(job(compile="on"), None, CUDA, 4)


def test_a_captured_step_replays_one_graph_per_step_and_reads_proposals_once():
    """The CUDA path's logic on the CPU, over a stand-in capture (tests/fake_cuda.py): the
    whole step (forward, argmax, the lookahead buffer's scatter, the proposal stored and fed
    back) captured once, in the first window, each step one replay with no other call, the
    window's proposals read once; the tokens are plain generate's, the lookahead buffer counts
    what the eager draft's layer-by-layer adds count, and a second request captures nothing
    and syncs nothing."""
    from fake_cuda import FakeCuda
    from specter.pio.elb import ExpertLookaheadBuffer

    lm, sw = _setup("tiny_deepseek")
    layers, experts = len(sw.draft_layers), lm.model.config.n_routed_experts
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    ref = _hf(lm.model, ids, 20)
    eager, captured = (ExpertLookaheadBuffer(layers, experts, CPU) for _ in range(2))
    sw.listen(eager.add)
    _run(lm, sw, ids, 20, 4)
    sw.draft_listeners.clear()
    outside: list = []
    sw.listen(captured.add, captured.add_all, in_graph=True)
    sw.listen(lambda l, t: None, lambda routes: outside.append(routes.shape))
    fake = FakeCuda()
    static = StaticKV(sw, compiler="eager", capture=fake.capture_graph)
    from collections import Counter

    from specter.counting import OpCounter

    with OpCounter() as counter:  # the capture under a counter (experiments/hotpath.py)
        assert _run(lm, sw, ids, 20, 4, static).tokens == ref
    assert static.captures == 1 and fake.captures == 1 and fake.log.device_syncs == 1
    assert fake.replays == static.steps_run > 0
    total = sum(counter.counts.values(), start=Counter())
    assert total["graph_replays"] == static.steps_run  # each step one replay, the capture none
    assert torch.equal(eager.counts, captured.counts) and captured.counts.sum() > 0
    assert len(outside) == static.steps_run  # not graph-safe: heard after each replay
    syncs = fake.log.device_syncs
    captured.reset()
    for k in (2, 6):  # another depth, another request: the same graph
        assert _run(lm, sw, ids, 20, k, static).tokens == ref
    assert static.captures == 1 and fake.log.device_syncs == syncs


def test_a_second_instance_captures_its_steps_after_an_eager_first_one():
    """own_kv (SpecMoEOff's layout) over the stand-in capture: each window's first step eager
    (the unseen committed tokens and the pending one), its proposal fed into the captured
    graph's buffers, the other steps replays; the tokens are plain generate's and the
    proposals the eager separate draft's (the same acceptance)."""
    from fake_cuda import FakeCuda
    from specter.decoding.draft import OwnKV

    lm, _ = _setup("tiny_deepseek", noise=0.9)  # rejections: windows catch up on corrections
    second, sw2 = _setup("tiny_deepseek", noise=0.9)
    sw2.mode = "draft"
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    ref = _hf(lm.model, ids, 24)
    eager = _run(lm, None, ids, 24, 4, OwnKV(second.model))
    fake = FakeCuda()
    heard: list = []  # the loop's events and the capture, in order

    class Heard:
        def forward(self, phase, tokens, context, rows):
            heard.append(("forward", phase))

        def draft_step(self, step, last):
            heard.append(("draft_step", step))

    def capture(fn, warm):
        heard.append(("capture",))
        return fake.capture_graph(fn, warm)

    static = StaticKV(sw2, compiler="eager", own_kv=True, capture=capture)
    got = speculative_greedy(lm.model, None, ids, 24, 4, CPU, Timing.wall(CPU).link,
                             eos_ids(lm.model), DeviceMemory(lm.model, CPU),
                             events=Events(Heard()), layout=static)
    assert got.tokens == eager.tokens == ref
    assert got.stats["accepted_lens"] == eager.stats["accepted_lens"]
    assert min(eager.stats["accepted_lens"]) < 4
    assert static.captures == 1 and fake.replays == static.steps_run > 0
    # captured between two steps (after the eager first one's, before the first replay's
    # forward), so no step's time holds the capture
    at = heard.index(("capture",))
    assert heard[at - 1] == ("draft_step", 1) and heard[at + 1] == ("forward", "draft")


def test_graphed_draft_layers_capture_no_shape_that_reads_the_routing_on_the_host(monkeypatch):
    """quant.graphs on a second instance (system.shared=false's per-window KV copy on CUDA:
    its layers graphed, the step eager) over the stand-in capture (tests/fake_cuda.py, where
    a host read inside a capture raises as on a GPU). The engine captures the lengths a
    window of K=10 feeds, 1 to 11 tokens; past one (token, k-slot) pair per expert
    gather_int4 goes expert by expert, reading the routing on the host (`counts.tolist()`),
    which no capture may do: tiny_deepseek has 64 experts, top 6, as DeepSeek-V2-Lite, so 11
    tokens (K >= 10) run eagerly and are not captured. Decoding at K=10 stays lossless. The
    check can fail: a layer that captured that shape anyway (as before: any length up to 16)
    fails its capture."""
    from fake_cuda import FakeCuda
    from specter.decoding.draft import CopiedKV
    from specter.quant.kernels import GraphedExperts

    lm, _ = _setup("tiny_deepseek")
    second = load_model(ModelConfig(name="tiny_deepseek", source="project", dtype="float32"),
                        CPU, progress=False)
    qe = calibrate.quantize_experts(second.model, calibrate.QuantSpec(method="rtn", bits=4,
                                                                      group=32), None, CPU)
    dm = DraftMode(second.model, qe, "gather_int4", CPU, graphs=True, mode="draft")
    fake = FakeCuda()
    for layer in dm.draft_layers:
        layer.cuda = fake
    k_max, top_k = 10, second.spec.top_k
    assert second.spec.num_experts == 64 and top_k == 6
    made = dm.warm_graphs(range(1, k_max + 2))  # build_speculative's lengths for one row
    assert made == len(dm.draft_layers) * k_max == fake.captures  # 11 tokens: eager
    assert all(layer.captures(10, top_k) and not layer.captures(11, top_k)
               for layer in dm.draft_layers)
    ids = lm.tokenizer(PROMPT)["input_ids"][:16]
    replays = fake.replays
    assert _run(lm, None, ids, 24, k_max, CopiedKV(second.model)).tokens == _hf(lm.model, ids, 24)
    assert fake.replays > replays and fake.captures == made  # replayed, nothing captured late
    monkeypatch.setattr(GraphedExperts, "captures", lambda self, tokens, k: tokens <= 16)
    with pytest.raises(RuntimeError, match="host read inside a CUDA graph capture"):
        dm.warm_graphs([k_max + 1])
