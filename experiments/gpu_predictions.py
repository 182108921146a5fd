"""What the next GPU check will show, written down before it runs (issue 56 item 1).

    python -m experiments.gpu_predictions [--gpus H100,H200] [--systems lru,specter]
                                          [--out docs/measurements/gpu-predictions.csv]

The GPU check's default stage (experiments/gpu_check.py) runs lru, specter, specter_hybrid,
specmoeoff at 16 and 24 GiB and resident at full on `model=deepseek model.weights=inflated`,
3 gsm8k items x 64 tokens, in real CUDA time. Its prediction is the same driver on the virtual
clock of the GPU's real-size profile (h100_realsize, h200_realsize) with the stand-in's twin:
the same inflated model at its full depth (27 layers, every MoE layer live) and at narrow
widths (`TWIN_NARROW`: small_deepseek's, the hidden size 256 and the experts' 128 so that
INT4 groups of 128 cover the values they cover at real size). An inflation's added widths are
zero (models/inflate.py), so the twin computes the real-width model's logits and decodes its
tokens; its every step is charged at DeepSeek-V2-Lite's sizes (hardware.charge=auto), its
GiB budgets count DeepSeek-V2-Lite's bytes (budget.py `bytes_spec`), and its captured steps'
kernels, counted at the real depth, at the profile's per-kernel floor (docs/clocks.md, "The
kernel floor"). Each row names
the commit whose clock and engine made it (`clock_commit`); a later engine or clock makes new
rows, never edited ones. The driver then prints them beside the real values (real/predicted).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from experiments import gpu_check

PROFILES = {"H100": "h100_realsize", "H200": "h200_realsize"}


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=gpu_check.REPO, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=gpu_check.REPO).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# the inflated stand-in at narrow widths (the docstring); the other widths are small_deepseek's
TWIN_NARROW = ("model.narrow={hidden_size:256,intermediate_size:384,moe_intermediate_size:128,"
               "num_attention_heads:4,num_key_value_heads:4,kv_lora_rank:96,"
               "qk_nope_head_dim:48,qk_rope_head_dim:24,v_head_dim:48,vocab_size:4096}")
# the draft backend a GPU's spec.compile=auto takes with triton installed (quant/build.py
# resolve_backend); on the CPU auto keeps gather_int4, which the clock charges otherwise
TWIN_OVERRIDES = (TWIN_NARROW, "quant.backend=fused_int4")
TWIN = "inflated-narrow"


def predict(gpu: str, systems: str | None = None, log=print) -> pd.DataFrame:
    """One GPU's prediction rows (PREDICTION_COLUMNS)."""
    import yaml

    profile = PROFILES[gpu]
    hw = yaml.safe_load((gpu_check.REPO / "conf" / "hardware" / f"{profile}.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        args = [tmp, "--hardware", profile, "--model", "deepseek", "--weights", "inflated",
                "--no-tests", "--budget-s", "100000", "--gpu", gpu,
                "--h2d-gbps", str(hw["h2d_bandwidth_Bps"] / 1e9)]
        if systems:
            args += ["--systems", systems]
        args += list(TWIN_OVERRIDES)
        gpu_check.main(args)
        t = pd.read_csv(Path(tmp) / "gpu_check.csv")
    note = (f"virtual clock {profile}, twin: the inflated model at narrow widths (charged at "
            "DeepSeek-V2-Lite's sizes), " + " ".join(TWIN_OVERRIDES))
    rows = pd.DataFrame({
        "gpu": gpu, "system": t["system"],
        "budget_gb": t["budget_key"].map(lambda b: str(b).replace(" GiB", "")),
        "tpot_ms": t["tpot_ms"], "warm_tpot_ms": t["tpot_ms_after_first"],
        "draft_ms_step": t["draft_ms_step"], "verify_ms_window": t["verify_ms_window"],
        "clock_commit": commit(), "note": note})
    return rows[list(gpu_check.PREDICTION_COLUMNS)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="H100,H200")
    ap.add_argument("--systems", default=None)
    ap.add_argument("--out", type=Path, default=gpu_check.PREDICTIONS)
    a = ap.parse_args(argv)
    new = pd.concat([predict(g, a.systems) for g in a.gpus.split(",")], ignore_index=True)
    old = pd.read_csv(a.out, dtype=str) if a.out.is_file() else pd.DataFrame()
    # a row per (gpu, system, budget): this clock's replaces an older one (git keeps those)
    out = pd.concat([old, new.astype(str)], ignore_index=True).drop_duplicates(
        ["gpu", "system", "budget_gb"], keep="last")
    out.to_csv(a.out, index=False, float_format="%.3f")
    print(new.to_string(index=False))


if __name__ == "__main__":
    main()
