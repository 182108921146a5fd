"""The counted hardware profile (specter/clock/counted.py): each launching operation and each
sync the code issues while decoding is charged to the virtual clock, so TPOT moves with the hot
path, by exactly what the counter counts."""

from __future__ import annotations

import pytest

from experiments import hotpath
from specter.errors import UserError

BASE = ["model=tiny_deepseek", "workload.items=1", "workload.max_new_tokens=12",
        "workload.stop_on_eos=false", "spec.k=4", "hardware=a100_pcie4_ideal",
        "hardware.charge=own", "hardware.launch_overhead_s=0", "hardware.layer_overhead_s=0",
        "quant.backend=cpu_int4", "progress=false"]


def _tpot(tmp_path, name, *extra):
    from experiments import runner
    from specter.settings import run_config

    return runner.run(run_config([*BASE, *extra, f"out_dir={tmp_path / name}"]),
               log=lambda *_: None).tpot_ms_mean


@pytest.mark.parametrize("system", ["resident", "specter"])
def test_a_counted_profile_charges_what_the_counter_counts(system, tiny_models, tmp_path):
    tiny_models("tiny_deepseek")
    plain = _tpot(tmp_path, "plain", f"system={system}")
    ops = _tpot(tmp_path, "ops", f"system={system}", "hardware.host_op_s=1e-5")
    syncs = _tpot(tmp_path, "syncs", f"system={system}", "hardware.sync_s=1e-4")
    total = next(r for r in hotpath.measure([system], BASE, tmp_path / "hot", log=lambda *_: None)
                 if r["phase"] == "decoding (all but prefill)")
    # TPOT in ms per token: 1e-5 s per launching op is 1e-2 ms; a sync at 1e-4 s is 1e-1 ms.
    # (The last forward's bookkeeping falls after the last token's time: ops within 3%.)
    assert ops - plain == pytest.approx(1e-2 * total["launching_per_token"], rel=0.03)
    reads = total["syncs"] + total["host_reads"]
    uncharged = reads - (syncs - plain) / 1e-1 * total["committed_tokens"]
    # uncharged: the reads after the last token's time (a window's end: acceptance, the plan)
    assert -1e-6 < uncharged < 5
    assert ops > plain and syncs > plain


def test_operations_in_a_layer_stand_for_the_real_layers(tiny_models, tmp_path):
    """At real sizes an operation inside a decoder layer counts once per real layer the
    modelled one stands for; outside the layers (embedding, lm head, bookkeeping) once."""
    tiny_models("tiny_deepseek")
    own = _tpot(tmp_path, "own", "system=resident", "hardware.host_op_s=1e-5")
    real = _tpot(tmp_path, "real", "system=resident", "hardware.host_op_s=1e-5",
                 "hardware.charge=real")
    assert real > 2 * own  # DeepSeek-V2-Lite's 27 layers against the tiny model's few


def test_a_profile_cannot_count_and_charge_constants_at_once(tiny_models, tmp_path):
    tiny_models("tiny_deepseek")
    with pytest.raises(UserError, match="a counted profile sets those to 0"):
        _tpot(tmp_path, "both", "system=resident", "hardware.host_op_s=1e-5",
              "hardware.expert_overhead_s=1e-4")

