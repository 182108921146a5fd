"""The independent anchors (experiments/anchors.py, issue 26): every row's setting composes into
a valid run on existing profiles, the table computes ours from the right records, and the
charged sizes of a quantized deployment are the publication's bits."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from experiments import anchors


def test_every_anchor_case_composes_on_existing_profiles():
    from specter.settings import run_config

    cases = anchors.runs()
    assert len(cases) == len(set(cases))
    for case in cases:
        rc = run_config([*case, "experiment=anchors", "workload.items=1"])
        rc.validate()
        hw = rc.hardware
        assert hw.clock == "virtual" and hw.matrix_flops > 0 and hw.h2d_bandwidth_Bps > 0
        assert hw.engine == case[0].rsplit("_", 1)[1]  # <gpu>_ideal / <gpu>_hf
        assert rc.model.stands_for in ("mixtral", "deepseek", "qwen3")


def test_the_publications_rows_are_all_there():
    a = anchors.anchors()
    by = lambda src, kind: [x for x in a if x.source == src and x.kind == kind]  # noqa: E731
    assert len(by(anchors.MO, "absolute")) == 23  # Table 2: 4 GPUs x 6 entries, less one typo
    assert {x.paper for x in by(anchors.MO, "absolute") if x.gpu == "t4"} == {
        2.092, 1.603, 1.567, 0.661, 1.168, 0.580}
    assert len(by(anchors.MI, "absolute")) == 6
    assert len(by(anchors.SE, "within")) == 4  # copy share + prefetch gain on three GPUs
    kt = by(anchors.KT, "absolute")  # every routed expert on the publication's own host
    assert len(kt) == 1 and "host=i9_14900kf_ddr5_2ch" in kt[0].runs[0].overrides
    ik = by(anchors.IK, "absolute")  # llama-bench tg128, every routed expert on the CPU
    assert [(x.model, x.paper) for x in ik] == [("DeepSeek-V2-Lite", 45.28), ("Qwen3-30B-A3B", 34.48)]
    assert all("host=ryzen7950x" in x.runs[0].overrides and x.gpu == "rtx4080" for x in ik)
    assert all(x.runs for x in a)
    # MoE-Infinity's mixtral-offloading number is called not comparable in the text: out of
    # the medians, and every row that reads it with it
    mo = [x for x in a if x.source == anchors.MI and "mixtral-offloading" in x.quantity]
    assert len(mo) == 3 and not any(x.matched for x in mo)
    assert all(x.note.startswith("not compared") for x in mo)


def _fake_records(tpot_of) -> pd.DataFrame:
    """One record per case, its configuration columns as the runner writes them."""
    from experiments.cases import override_value

    rows = []
    for case in anchors.runs():
        r = {"experiment": "anchors"}
        for o in case:
            key, _, value = o.partition("=")
            r[anchors.GROUPS.get(key, f"cfg.{key}")] = override_value(value)
        r["tpot_ms"] = tpot_of(r)
        rows.append(r)
    return pd.DataFrame(rows)


def test_table_reads_each_rows_own_records():
    def tpot(r):  # distinct per system and profile, so a wrong pick changes the numbers
        base = {"mo_sm": 400.0, "lru": 500.0, "transformers": 1000.0, "resident": 50.0,
                "quasi_hidden": 450.0, "vllm_offload": 200.0, "host_experts": 300.0}[r["system"]]
        return base * (2.0 if r["hardware"].endswith("_hf") else 1.0) \
            * (1.25 if r.get("cfg.hardware.expert_bits") == 3 else 1.0) \
            * (({11: 1.1, 3: 1.3}.get(r.get("cfg.hardware.quant_meta_bytes"), 1.0))
               if r["hardware"] == "rtx4080_ideal" else 1.0)  # ik_llama's two rows

    t = anchors.table(_fake_records(tpot))
    assert t["ours"].notna().all()
    row = lambda q, prof: t[(t["quantity"] == q) & (t["profile"] == prof)].iloc[0]  # noqa: E731
    full = row("tokens/s, full algorithm, 2-bit experts", "t4_hf")
    assert full["ours"] == pytest.approx(1e3 / 800.0)
    assert full["ratio"] == pytest.approx(full["ours"] / 2.092)
    assert row("tokens/s, full algorithm, 3-bit experts", "t4_ideal")["ours"] == pytest.approx(2.0)
    assert row("speed ratio, full / accelerate (2-bit)", "rtx3060_ideal")["ours"] == pytest.approx(2.5)
    assert row("speed ratio A100 / T4, accelerate offload, 2-bit experts",
               "a100_sxm_80g_hf/t4_hf")["ours"] == pytest.approx(1.0)
    share = row("copy share of TPOT under on-demand loading", "rtx_a6000_ideal")
    assert share["ours"] == pytest.approx(0.9) and share["note"].startswith("inside the published range: no")
    gain = row("TPOT with next-layer prefetch / TPOT on demand", "gh200_hf")
    assert gain["ours"] == pytest.approx(0.9) and not gain["matched"]  # another model there
    vllm = t[t["system"] == "vllm_offload"]
    assert set(vllm[vllm["kind"] == "absolute"]["engine"]) == {"ideal"}  # vLLM's engine only
    assert row("s/token, vLLM 0.8.5 (cpu_offload_gb)", "rtx_a5000_ideal")["ours"] == pytest.approx(0.2)
    kt = t[t["source"] == anchors.KT].iloc[0]  # the CPU-expert row, on its own host
    assert kt["ours"] == pytest.approx(1e3 / 300.0) and kt["ratio"] == pytest.approx(kt["ours"] / 12.0)
    ik = t[t["source"] == anchors.IK].set_index("model")["ours"]
    assert ik["DeepSeek-V2-Lite"] == pytest.approx(1e3 / 330.0)
    assert ik["Qwen3-30B-A3B"] == pytest.approx(1e3 / 390.0)
    med = anchors.medians(t)
    assert set(med["source"]) == {anchors.MO, anchors.MI, anchors.SE, anchors.KT, anchors.IK}
    assert (med["rows"] > 0).all() and med["median |log ratio|"].map(math.isfinite).all()


def test_missing_records_leave_ours_empty_not_zero():
    t = anchors.table(pd.DataFrame({"experiment": [], "tpot_ms": []}))
    assert len(t) and t["ours"].isna().all()


def test_hqq_deployment_charges_the_publications_bits():
    from specter.clock.costmodel import ChargedSizes

    base = dict(source="x", elem_bytes=2, attn_params=64 * 1000, router_params=0, shared_params=0,
                dense_mlp_params=0, expert_params=16 * 1000, lm_head_params=0,
                kv_elems_per_token=0, heads=1, head_dim=1)
    s = ChargedSizes(**base, expert_bits=2, attn_bits=4, quant_group=16, attn_quant_group=64,
                     quant_meta_bytes=2)
    assert s.expert_bytes * 8 / s.expert_params == pytest.approx(3.0)  # 2 + 16 bits / 16
    assert s.attn_bytes * 8 / s.attn_params == pytest.approx(4.25)  # 4 + 16 bits / 64
    old = ChargedSizes(**base, expert_bits=2, attn_bits=4, quant_group=16)  # fp16 scale + zero
    assert old.expert_bytes * 8 / old.expert_params == pytest.approx(4.0)
    assert old.attn_bytes == 64 * 1000 // 2 + 4000 * 4


def test_a_recorded_run_is_found_by_its_case(tmp_path):
    """A real run of an anchor-shaped case (quantized charges, slots, a new profile) on a tiny
    model reads back through the same selection the table uses."""
    from experiments.cases import Case, run_cases

    case = ("hardware=t4_ideal", "model=tiny_mixtral", "system=mo_sm", "budget=high",
            "budget.slots=4", *anchors.hqq(2))
    assert run_cases(tmp_path, [Case(case)], ["workload.items=1", "workload.max_new_tokens=6",
                                             "workload.repeats=1"], experiment="anchors",
                     log=lambda *_: None) == 0
    from experiments import records

    df = records.load(tmp_path)
    assert set(df["experiment"]) == {"anchors"}
    tp = anchors._tpot(df, case)
    assert tp > 0 and tp == pytest.approx(float(df["tpot_ms"].mean()))
    fp16_meta = tuple("hardware.quant_meta_bytes=4" if o.startswith("hardware.quant_meta_bytes")
                      else o for o in case)
    assert math.isnan(anchors._tpot(df, fp16_meta))  # another deployment's case is not this one
    assert int(df["charged.quant_meta_bytes"].iloc[0]) == 2


def test_ik_llama_rows_charge_the_files_bits_per_weight():
    """The GGUF files' bits per weight, from their stated sizes and weights (PR #232: 9.78 GiB
    over 15.71 B; issue #490: experts at 4.75 once the Q8_0 rest is taken out), as charged."""
    def bits(run):
        o = dict(x.split("=", 1) for x in run.overrides)
        return (int(o["hardware.expert_bits"])
                + 8 * int(o["hardware.quant_meta_bytes"]) / int(o["hardware.quant_group"]))
    lite, qwen3 = (a.runs[0] for a in anchors.anchors("ik_llama"))
    assert abs(bits(lite) - 9.78 * 2**30 * 8 / 15.71e9) < 0.05
    assert bits(qwen3) == 4.75


def test_source_selects_rows_and_an_unknown_one_is_refused(tmp_path, capsys):
    assert {a.source for a in anchors.anchors("ik_llama")} == {anchors.IK}
    assert {a.source for a in anchors.anchors("ik_llama, ktransformers")} == {anchors.IK, anchors.KT}
    assert all("ryzen7950x" in " ".join(c) for c in anchors.runs(only="ik_llama"))
    assert anchors.main([str(tmp_path), "--source", "no such source", "--table-only"]) == 2
    assert "no anchor's source names 'no such source'" in capsys.readouterr().err
