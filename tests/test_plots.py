"""experiments.plots: every Result renders from a synthetic results tree with the records' real
column names (PNG, PDF and a Markdown table each), paper numbers appear beside ours, and the
CLI's edges (missing root, unknown name, experiments without records) are one line each.
Records of two engine profiles of the same cases (a100_pcie4_ideal, a100_pcie4_hf) render one
panel per profile and a profile column; the main TPOT panels are log-scale."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from experiments import memory_table, records, routing_report
from experiments.plots import RESULTS, base, cache, main_tpot, paper
from experiments.plots.cli import load_all, main

CONF = Path(__file__).resolve().parent.parent / "conf"
HW = {"hardware": "a100_pcie4_ideal", "clock": "virtual", "device": "cpu", "dataset_standin": True}
CHARGED = {"deepseek": "real:deepseek-ai/DeepSeek-V2-Lite", "qwen": "real:Qwen/Qwen1.5-MoE-A2.7B"}
MODELS = {"small_deepseek": "deepseek", "small_qwen": "qwen", "small_dense": "deepseek"}
SLOTS = {"low": 8, "high": 16, "xhigh": 32}
NO_PAPER = {"kernel", "hybrid", "crossover", "anchors"}  # results whose tables have no paper (A100) column


def _row(experiment, system, model="small_deepseek", budget="high", dataset="gsm8k", rid=0,
         **extra):
    return {"experiment": experiment, "cfg.experiment": experiment, "system": system,
            "cfg.system.name": system, "model": model, "cfg.model.name": model,
            "cfg.model.stands_for": MODELS[model], "budget": budget, "budget_slots": SLOTS[budget],
            "dataset": dataset, "charged.source": CHARGED[MODELS[model]], **HW,
            "request_id": f"{dataset}-{rid:03d}", "repeat": 0, "output_tokens": [5, 6, 7, 8],
            "n_output_tokens": 4, **extra}


def _spec(k, **extra):
    return {"k": float(k), "cfg.spec.k": k, "acceptance_rate": 0.9, "mean_accepted_len": 3.0, **extra}


def synthetic_rows() -> list[dict]:
    rows = []
    tpot = {"resident": 5.0, "transformers": 300.0, "lru": 90.0, "specmoeoff": 60.0, "specter": 40.0}
    for (system, t), dataset in itertools.product(tpot.items(), ["gsm8k", "humaneval"]):
        extra = _spec(8) if system in ("specmoeoff", "specter") else {}
        rows.append(_row("main", system, "small_qwen", dataset=dataset, tpot_ms=t, **extra))
    for dataset in ("gsm8k", "humaneval"):  # SpecMoEOff at the profiled K: its own bar
        rows.append(_row("main", "specmoeoff", "small_qwen", dataset=dataset, tpot_ms=45.0,
                         **_spec(32, **{"cfg.spec.tune_own_k": True})))
    for system, t in tpot.items():  # make run's main job: one dataset, the same columns
        if system != "transformers":
            extra = _spec(16) if system in ("specmoeoff", "specter") else {}
            rows.append(_row("quickstart", system, tpot_ms=t, **extra))
    for system, budget in itertools.product(["lru", "specter"], ["low", "high", "xhigh"]):
        spec = system == "specter"
        rows.append(_row("cache", system, budget=budget, tpot_ms=50.0, hit_rate=0.5 + SLOTS[budget] / 100,
                         hit_rate_cap=0.6 + SLOTS[budget] / 100, hit_rate_tokens=0.6,
                         prefetch_precision=0.9 if spec else None, plan_recall=0.8 if spec else None))
    for orch, shared, reorder in [(True, True, True), (False, True, True), (False, False, True),
                                  (False, False, False)]:
        rows.append(_row("ablation", "specter", tpot_ms=70.0 + 10 * (3 - orch - shared - reorder),
                         **{"cfg.system.orchestrator": orch, "cfg.system.shared": shared,
                            "cfg.system.reorder": reorder}, **_spec(16), hit_rate=0.8,
                         h2d_hidden_frac=0.4))
    for system in ("lru", "specter"):
        rows.append(_row("latency", system, tpot_ms=60.0, h2d_ms=500.0, exposed_wait_ms=300.0,
                         h2d_hidden_frac=0.4, n_transfers=70, h2d_bytes=1e10, e2e_ms=900.0))
    for (method, bits), rid in itertools.product([("gptq", 4), ("rtn", 2)], range(2)):
        rows.append(_row("fidelity", "fidelity", rid=rid, **{"draft.method": method, "draft.bits": bits,
                         "draft.effective_groups": "[32, 64]", "draft.bytes": 1000 * bits},
                         clock="wall", hardware="auto", fidelity_topk=0.9 + 0.01 * rid,
                         fidelity_top1=0.95, fidelity_per_layer=[0.9, 0.92, 0.88],
                         fidelity_per_position=[1.0, 0.8, 0.9, 0.95], draft_token_match=0.97,
                         distinct_4=1.0, tpot_ms=3.0))
    for model in ("small_deepseek", "small_dense"):
        rows.append(_row("working_set", "lru", model, tpot_ms=100.0, distinct_experts_per_forward=6.0,
                         distinct_experts_mean=30.0))
        for k in (1, 2, 4, 16):
            rows.append(_row("working_set", "lru_s", model, tpot_ms=100.0 / (1 + k / 4),
                             distinct_experts_per_forward=6.0 + k, distinct_experts_mean=30.0,
                             **_spec(k)))
    for k in (2, 4, 8, 16):
        rows.append(_row("depth", "lru_s", tpot_ms=50.0 + (k - 8) ** 2, hit_rate=0.7, **_spec(k)))
    for noise in (0.0, 0.25, 0.5):
        rows.append(_row("oracle", "specter", tpot_ms=60.0 + 40 * noise, **_spec(16),
                         **{"cfg.system.prefetch_noise": noise}, prefetch_precision=1 - noise,
                         plan_recall=0.7, hit_rate=0.9 - noise, prefetch_corrupted=noise))
    for (system, tput), b in itertools.product({"specter": 200.0, "specmoeoff": 100.0,
                                                "mo_sm": 25.0}.items(), (1, 32)):
        for rid in range(2):  # two rows of one batch: its throughput columns repeat
            rows.append(_row("batch", system, dataset="mix", rid=rid, tpot_ms=32e3 / tput,
                             **{"cfg.workload.batch": b, "batch_id": "r0-000", "batch_size": b,
                                "batch_tokens_per_s": tput * b / 32, "batch_tokens": 64,
                                "h2d_bytes": 64 * 1e6, "charged.expert_params": 1e6,
                                "charged.elem_bytes": 2, "hit_rate": 0.3,
                                "h2d_hidden_frac": 0.5}))
    for (system, tpot), budget in itertools.product({"resident": 40.0, "lru": 80.0,
                                                     "lru_hybrid": 60.0, "specter": 50.0,
                                                     "specter_hybrid": 48.0}.items(),
                                                    ("high", "low")):
        hybrid = system.endswith("_hybrid")
        rows.append(_row("hybrid", system, budget=budget, tpot_ms=tpot,
                         host_frac=0.5 if hybrid else 0.0, host_experts=10 if hybrid else 0,
                         hit_rate=None if system == "resident" else 0.6))
    # crossover: host_experts from 40 to 10 ms as the host's bandwidth grows, Specter flat at 20
    for system, bw, tpot in (("host_experts", 25e9, 40.0), ("host_experts", 60e9, 10.0),
                             ("host_experts", 300e9, 8.0), ("specter", 300e9, 20.0)):
        rows.append(_row("crossover", system, tpot_ms=tpot,
                         **{"cfg.hardware.host_mem_bandwidth_Bps": bw}))
    from experiments import anchors
    from experiments.cases import override_value

    for i, case in enumerate(anchors.runs()):  # every anchor case, its config read back
        row = {"experiment": "anchors", "cfg.experiment": "anchors", "clock": "virtual",
               "dataset": "gsm8k", "request_id": f"gsm8k-{i:03d}", "repeat": 0,
               "tpot_ms": 100.0 + i}
        for o in case:
            key, _, value = o.partition("=")
            row[anchors.GROUPS.get(key, f"cfg.{key}")] = override_value(value)
        rows.append(row)
    for backend, tokens in itertools.product(["reference", "cpu_int4"], [1, 16]):
        rows.append({"experiment": "kernel", "backend": backend, "shape": "2048x1408",
                     "tokens": tokens, "ms": 0.1 * tokens, "clock": "wall", "device": "cpu",
                     "hardware": "cpu", "request_id": f"{backend}-{tokens}", "repeat": 0})
    return rows


# Two engine profiles of the same cases: the eager one slower; its records carry `engine`, the
# ideal one's do not (older records: the engine comes from the name's suffix).
PROFILED = ("main", "cache", "latency", "ablation", "oracle", "depth", "working_set", "batch")
TWO_PROFILED = {"main_tpot", "cache_hit_rate", "h2d_hiding", "ablation", "oracle", "depth",
                "working_set", "batch"}


def two_profile_rows() -> list[dict]:
    rows = []
    for row in synthetic_rows():
        rows.append(row)
        if row["experiment"] not in PROFILED:
            continue
        hf = {**row, "hardware": "a100_pcie4_hf", "engine": "hf"}
        for c in ("tpot_ms", "e2e_ms"):
            if c in hf and hf[c] is not None:
                hf[c] = hf[c] * (3.0 if hf["system"] == "transformers" else 2.0)
        rows.append(hf)
    return rows


def _write_tree(root: Path, rows: list[dict]) -> Path:
    for i, row in enumerate(rows):  # two trees under the root, as sweeps leave them
        sub = root / ("sweep_a" if i % 2 else "sweep_b")
        case = {"i": i, "experiment": row["experiment"], "hw": row.get("hardware")}
        records.CaseStore(sub, case).write(row)
    return root


@pytest.fixture(scope="module")
def tree2(tmp_path_factory) -> Path:
    return _write_tree(tmp_path_factory.mktemp("results2"), two_profile_rows())


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    for i, row in enumerate(synthetic_rows()):  # two trees under the root, as sweeps leave them
        sub = root / ("sweep_a" if i % 2 else "sweep_b")
        records.CaseStore(sub, {"i": i, "experiment": row["experiment"]}).write(row)
    memory_table.write_records(str(root), [
        {"model": "qwen", "source": "real:Qwen/Qwen1.5-MoE-A2.7B", "budget": budget, "slots": slots,
         "context": 12288, "non_expert_GB": 3.7, "int4_draft_GB": 6.4, "target_slots_GB": 0.4 * slots,
         "kv_GB": 2.4, "shared_GB": 12.5 + 0.4 * slots, "separate_GB": 18.6 + 0.4 * slots, "saving": 0.3}
        for budget, slots in (("high", 15), ("low", 8))])
    for model, fam in (("small_deepseek", "deepseek"), ("tiny_mixtral", None)):
        routing_report.write_record(root, model, Path(f"/ck/{model}"), synthetic_routing(fam))
    return root


def synthetic_routing(family) -> dict:
    """A routing report as routing_report.model_report returns it (draft side included)."""
    from specter.models.routing_stats import WINDOWS, random_working_set

    e, k = (64, 6) if family else (8, 2)
    ws = {n: min(e, k * n ** 0.6) for n in WINDOWS}
    return {"experts": e, "top_k": k, "moe_layers": 3, "prompts": 25, "tokens": 64,
            "working_set": ws, "random_working_set": {n: random_working_set(e, k, n) for n in WINDOWS},
            "growth_1_to_17": ws[17] / ws[1], "reuse": 0.3, "load_entropy": 0.9,
            "distinct_4": 0.7, "stands_for": family,
            "target": routing_report.check(ws, family), "fidelity_topk": 0.95,
            "draft_token_match": 0.97, "draft": "gptq w4g128",
            "acceptance": {kk: 0.99 - 0.01 * kk for kk in routing_report.ACCEPT_KS},
            "recipe": {"router_balance": 0.03}}


def test_every_result_renders(tree, tmp_path, capsys):
    out = tmp_path / "figures"
    assert main([str(tree), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(RESULTS)
    assert not [line for line in lines if "skipped" in line or "FAILED" in line], lines
    for res in RESULTS:
        for ext in ("png", "pdf", "md"):
            files = sorted(out.glob(f"{res.name}*.{ext}"))
            assert files and all(f.stat().st_size > 0 for f in files), (res.name, ext)
        if res.experiment not in NO_PAPER:
            md = (out / f"{res.name}.md").read_text()
            assert "paper (A100)" in md, res.name
            assert "clock" in md and (out / f"{res.name}.tex").read_text().count("\\toprule") == 1


def test_tables_hold_our_numbers_beside_the_papers(tree, tmp_path, capsys):
    out = tmp_path / "f"
    assert main([str(tree), "--out", str(out), "--only", "main_tpot", "oracle", "working_set"]) == 0
    main_md = (out / "main_tpot.md").read_text()
    # small_qwen, all datasets: specmoeoff 60 / specter 40 = 1.5x; paper 35.3 ms and 66.4/35.3
    specter_all = next(line for line in main_md.splitlines() if "| specter | all |" in line)
    assert "| 40 | 1.5 |" in specter_all and "35.3" in specter_all and "1.881" in specter_all
    tuned = next(line for line in main_md.splitlines() if "| specmoeoff_tuned_k | all |" in line)
    assert "| 45 | 1.333 |" in tuned  # beside, not instead of, SpecMoEOff at its own K
    assert "over SpecMoEOff at its tuned K 1.12x mean" in main_md
    assert "yes (1/1)" in (out / "oracle.md").read_text()
    ws = (out / "working_set.md").read_text()
    assert "31.7" in ws and "small_dense" in ws
    assert "skipped" not in capsys.readouterr().out


def test_cli_edges(tree, tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(tree), "--only", "no_such_result"]) == 2
    assert "unknown result" in capsys.readouterr().err
    empty = tmp_path / "empty"
    records.CaseStore(empty, {"x": 1}).write(_row("smoke", "lru", tpot_ms=1.0))
    assert main([str(empty), "--out", str(tmp_path / "o"), "--only", "depth"]) == 0
    assert capsys.readouterr().out.strip() == "depth: skipped: no depth records"


def test_experiment_overlays_name_their_records():
    """An overlay's `experiment:` reaches the records' experiment column (the plots select on it)."""
    from hydra import compose, initialize_config_dir

    for path in sorted((CONF / "experiment").glob("*.yaml")):
        named = [line.split(":", 1)[1].strip() for line in path.read_text().splitlines()
                 if line.startswith("experiment:")]
        if not named:
            continue
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"experiment={path.stem}"])
        assert cfg.experiment == named[0], path.name


def _visible(fig) -> list:
    return [a for a in fig.axes if a.get_visible()]


def test_main_tpot_is_log_scale_with_a_speedup_panel(tree):
    df = load_all(tree)
    df = df[df["experiment"] == "main"].reset_index(drop=True)
    [(stem, fig)] = main_tpot.figures(main_tpot.table(df), df)
    try:
        axes = _visible(fig)
        assert len(axes) == 2  # TPOT over speedup, one profile
        assert axes[0].get_yscale() == "log"
        assert "speedup over SpecMoEOff" in axes[1].get_title()
        ticks = [t.get_text() for t in axes[1].get_xticklabels()]
        assert "specter\n1.50x" in ticks and "specmoeoff\n1.00x" in ticks  # 60 / 40
        # paper diamonds on both panels, labelled as the A100's
        assert all(any(lab.startswith("paper (A100)") for lab in a.get_legend_handles_labels()[1])
                   for a in axes)
        assert "profile a100_pcie4_ideal (ideal roofline engine)" in fig._suptitle.get_text()
        assert "virtual clock" in fig._suptitle.get_text()
    finally:
        base.plt.close(fig)


def test_tpot_axis_is_linear_from_zero_when_the_bars_are_close(tmp_path):
    """make run's four systems span 45-73 ms: on a log axis cut at 45 ms Specter's bar all but
    vanished, so a narrow spread is drawn linear from 0; the speedup panel labels ticks
    inside its narrow range, not only 1x."""
    tpot = {"resident": 66.1, "lru": 73.4, "specmoeoff": 60.8, "specter": 45.4}
    rows = [_row("quickstart", s, tpot_ms=t, **(_spec(16) if s.startswith("spec") else {}))
            for s, t in tpot.items()]
    for i, r in enumerate(rows):
        records.CaseStore(tmp_path, {"i": i, "experiment": "quickstart"}).write(r)
    df = load_all(tmp_path)
    [(stem, fig)] = main_tpot.figures(main_tpot.table(df), df)
    try:
        top, bottom = _visible(fig)
        assert top.get_yscale() == "linear" and top.get_ylim()[0] == 0
        assert top.get_ylim()[1] >= 73.4 and "log" not in top.get_ylabel()
        labels = [t.get_text() for t in bottom.get_yticklabels()]
        assert "1x" in labels and len(labels) >= 3, labels  # 0.83x-1.34x: 0.9x, 1.1x, 1.25x too
    finally:
        base.plt.close(fig)
    wide = main_tpot.table(load_all(tmp_path).assign(tpot_ms=[6.0, 73.4, 60.8, 45.4]))
    [(stem, fig)] = main_tpot.figures(wide, df)
    try:
        top = _visible(fig)[0]
        assert top.get_yscale() == "log" and top.get_ylim()[0] < 6.0  # every bar has length
    finally:
        base.plt.close(fig)


@pytest.mark.slow
def test_two_profiles_render_side_by_side(tree2, tmp_path, capsys):
    out = tmp_path / "figures"
    assert main([str(tree2), "--out", str(out), "--only", *sorted(TWO_PROFILED)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(TWO_PROFILED)
    assert not [line for line in lines if "skipped" in line or "FAILED" in line], lines
    for res in RESULTS:
        if res.name not in TWO_PROFILED:
            continue
        md = (out / f"{res.name}.md").read_text()
        header = next(line for line in md.splitlines() if line.startswith("| "))
        assert "| profile | engine |" in header, res.name
        body = md.split("\n_")[0]
        assert "a100_pcie4_hf" in body and "a100_pcie4_ideal" in body, res.name
        assert "| hf |" in body and "| ideal |" in body, res.name  # derived for the older records
        assert "a100_pcie4_hf (eager engine)" in md, res.name
    df = load_all(tree2)
    main_df = df[df["experiment"] == "main"].reset_index(drop=True)
    [(stem, fig)] = main_tpot.figures(main_tpot.table(main_df), main_df)
    try:
        axes = _visible(fig)
        assert len(axes) == 4  # TPOT and speedup, each per profile side by side
        tops = axes[:2]
        assert all(a.get_yscale() == "log" for a in tops)
        assert tops[0].get_ylim() == tops[1].get_ylim()
        titles = " ".join(a.get_title() for a in axes)
        assert "a100_pcie4_ideal (ideal roofline engine)" in titles
        assert "a100_pcie4_hf (eager engine)" in titles
        for a in axes:
            assert any(lab.startswith("paper (A100)") for lab in a.get_legend_handles_labels()[1])
    finally:
        base.plt.close(fig)
    cache_df = df[df["experiment"] == "cache"].reset_index(drop=True)
    fig = cache.figure(cache.table(cache_df), cache_df)
    try:
        assert len(_visible(fig)) == 4  # hit_rate and hit_rate_tokens, each per profile
    finally:
        base.plt.close(fig)


def test_cache_table_has_the_cap_and_the_caveat(tree, tmp_path):
    out = tmp_path / "f"
    assert main([str(tree), "--out", str(out), "--only", "cache_hit_rate"]) == 0
    md = (out / "cache_hit_rate.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| "))
    for c in ("hit_rate", "hit_rate_cap", "hit_rate_tokens", "prefetch_precision", "plan_recall"):
        assert f"| {c} |" in header, c
    assert "99.85%/98.62%/96.25%" in md and "not like for like" in md
    specter_high = next(line for line in md.splitlines() if "| high | 16 | specter |" in line)
    assert "| 0.66 | 0.76 | 0.6 | 0.9 | 0.8 |" in specter_high
    df = load_all(tree)
    df = df[df["experiment"] == "cache"].reset_index(drop=True)
    fig = cache.figure(cache.table(df), df)
    try:
        labels = fig.axes[0].get_legend_handles_labels()[1] + sum(
            (a.get_legend_handles_labels()[1] for a in fig.axes), [])
        assert cache.CAP_LABEL in labels
    finally:
        base.plt.close(fig)


def test_engine_and_profile_labels():
    assert base.engine_of("a100_pcie4_hf") == "hf" and base.engine_of("h200_ideal") == "ideal"
    assert base.engine_of("a100_pcie4") == "-" and base.engine_of("x", "hf") == "hf"
    assert base.profile_label("a100_pcie4_hf") == "a100_pcie4_hf (eager engine)"
    assert base.profile_label("cpu") == "cpu"


def test_batch_table_measures_throughput_per_batch_beside_the_paper(tree):
    from experiments.plots import batch

    df = load_all(tree)
    t = batch.table(df[df["experiment"] == "batch"].reset_index(drop=True))
    b32 = t[t["B"] == 32].set_index("system")
    assert b32.loc["specter", "throughput_tok_s"] == 200.0  # per batch, not per row
    assert b32.loc["mo_sm", "specter_throughput_x"] == pytest.approx(8.0)
    assert b32.loc["specter", "experts_per_token"] == pytest.approx(0.5)  # 64e6 B / 2e6 / 64
    assert b32.loc["specter", "TPOT ms paper (A100)"] == paper.BATCH32_DEEPSEEK["specter"][0]
    assert b32.loc["specmoeoff", "specter x paper (A100)"] == pytest.approx(130.3 / 40.2)
    assert t[t["B"] == 1]["TPOT ms paper (A100)"].isna().all()  # the paper has B = 32 only
    assert b32.loc["specter", "tpot_x_tput"] == pytest.approx(32.0)


def test_hybrid_table_is_relative_to_resident_and_specter(tree):
    from experiments.plots import hybrid

    df = load_all(tree)
    t = hybrid.table(df[df["experiment"] == "hybrid"].reset_index(drop=True))
    high = t[t["budget"] == "high"].set_index("system")
    assert high.loc["lru_hybrid", "x_resident"] == pytest.approx(1.5)
    assert high.loc["specter_hybrid", "x_specter"] == pytest.approx(0.96)
    assert high.loc["specter_hybrid", "host_frac"] == 0.5
