"""The device's per-kernel floor, fit on a real GPU's captured draft steps (issue 56).

    python -m experiments.kernel_floor [--twin-records DIR] [--write-twin DIR]

The fixture is the first real-size GPU run with trained routing
(docs/measurements/h200-2026-12-04-inflated: DeepSeek-V2-Lite inflated from small_deepseek,
one H200, specter at 16 GiB, 2 gsm8k items x 64 tokens, each draft step one replay of a
captured CUDA graph, quant.backend gather_int4). Its draft took 87.5 and 94.9 ms a window of
16 steps. The virtual clock charged a captured step only its kernels' roofline time, about a
seventh of that; a GPU runs a graph's kernels one after another, each costing a few
microseconds whatever its size (docs/clocks.md, "The kernel floor").

The twin: that run's stand-in (the inflation before its live-swing recipe of 2026-12-06: 23 of
26 MoE layers zero-output copies) decoded exactly small_deepseek's tokens, so
`model=small_deepseek hardware=h200_realsize` on the same prompts is that run's virtual twin
(checked here: the same tokens, the same windows), its draft charged at the real model's
sizes. Run with `hardware.kernel_floor_s=0` (committed under
docs/measurements/kernel-floor-2026-12-06/twin/, `--write-twin` makes it again), each twin
step's draft time is its roofline and the host's charges; the floor adds `N x floor` a
step, N the kernels of one real-depth step (`experiments.kernel_count`: inductor's kernels
after fusion at 27 layers, counted on the CPU; the captured graph's own count on a GPU).
So the fit is

    floor = mean over requests (real draft ms a step - twin's) / N

(a step: a window's draft time over its K). Held out, not fit: the run's verification windows
(eager: each kernel issued by the host at host_op_s, which hides a floor under it, so the floor
leaves them as the twin had them; their disagreement is the engine's change since that run,
named in the note), and the random-weight rows of experiments.clock_check (eager draft and
verification: unchanged by the floor, checked). tests/test_kernel_floor.py holds the profile's
floor to this fit and fails when it is off by 2x either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd


def load_records(path: Path) -> pd.DataFrame:
    """Every parquet row under a folder, or under a .tgz of one (however deep)."""
    import tarfile
    import tempfile

    if path.is_dir():
        return pd.concat([pd.read_parquet(f) for f in sorted(path.rglob("*.parquet"))],
                         ignore_index=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        return load_records(Path(tmp))

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "docs" / "measurements" / "h200-2026-12-04-inflated" / "records.tgz"
HERE = ROOT / "docs" / "measurements" / "kernel-floor-2026-12-06"
TWIN = HERE / "twin"
COUNT = HERE / "kernel-count.json"  # experiments.kernel_count --layers 3 27 --narrow
KEY = ["system", "budget_gb", "request_id"]
BAND = 0.15  # a draft step's predicted time within 15% of the real one
TWIN_ARGS = ["model=small_deepseek", "system=specter", "hardware=h200_realsize", "budget=gb",
             "budget.gb=16", "dataset=gsm8k", "workload.items=2", "workload.prompt_tokens=16",
             "workload.max_new_tokens=64", "workload.repeats=1", "quant.method=rtn",
             "spec.compile=on", "hardware.kernel_floor_s=0", "seed=0", "progress=false"]


def step_kernels(path: Path = COUNT) -> int:
    """One real-depth (27-layer) draft step's kernels, as counted."""
    rows = json.loads(path.read_text())
    deep = [r for r in rows if r["layers"] == 27]
    if not deep:
        raise ValueError(f"{path} holds no 27-layer count")
    return int(deep[0]["step_kernels"])


def write_twin(out: Path = TWIN, log=print) -> Path:
    """The twin's records (the runner at `TWIN_ARGS`)."""
    from experiments import runner
    from specter.settings import run_config

    runner.run(run_config([*TWIN_ARGS, f"out_dir={out}"]), log=log)
    return out


def pairs(real: pd.DataFrame, twin: pd.DataFrame) -> pd.DataFrame:
    """One line per real Specter request with its twin's draft and verification times; the
    twin must have decoded the same tokens (its windows may differ: the draft's INT4 math runs
    in the CPU's precision there, bf16 on the GPU, so a few proposals differ; a step is a step,
    so the fit is per draft step)."""
    real = real[real["system"] == "specter"]
    cols = ["draft_ms_per_window", "verify_ms_per_window", "k_window_mean", "windows",
            "output_tokens", "tpot_ms"]
    t = twin[["request_id"] + cols].rename(columns={c: f"twin_{c}" for c in cols})
    out = real[KEY + cols].merge(t, on="request_id", how="inner")
    if len(out) != len(real) or not len(out):
        raise ValueError("a real request has no twin")
    for a, b in zip(out["output_tokens"], out["twin_output_tokens"]):
        if list(a) != list(b):
            raise ValueError("the twin decoded other tokens than the real run: not its twin")
    out["step_ms"] = out["draft_ms_per_window"] / out["k_window_mean"]
    out["twin_step_ms"] = out["twin_draft_ms_per_window"] / out["twin_k_window_mean"]
    return out.drop(columns=["output_tokens", "twin_output_tokens"]).sort_values(KEY,
                                                                                  ignore_index=True)


def fit(p: pd.DataFrame, kernels: int) -> float:
    """The floor (seconds a kernel) that makes the twin's draft steps the real ones (each
    request's mean step alike)."""
    return float((p["step_ms"] - p["twin_step_ms"]).mean()) / 1e3 / kernels


def predict(p: pd.DataFrame, kernels: int, floor_s: float) -> pd.DataFrame:
    """Each request's draft window at `floor_s`, beside the real one; verification as the
    twin had it (eager: the floor is under the host's issue)."""
    out = p[KEY].copy()
    out["real_step_ms"] = p["step_ms"]
    out["floorless_step_ms"] = p["twin_step_ms"]
    out["predicted_step_ms"] = p["twin_step_ms"] + kernels * floor_s * 1e3
    out["draft_error"] = out["predicted_step_ms"] / out["real_step_ms"] - 1
    out["real_verify_ms"] = p["verify_ms_per_window"]
    out["predicted_verify_ms"] = p["twin_verify_ms_per_window"]
    out["verify_error"] = out["predicted_verify_ms"] / out["real_verify_ms"] - 1
    return out


def profile_floor(name: str = "h200_realsize") -> float:
    import yaml

    return float(yaml.safe_load((ROOT / "conf" / "hardware" / f"{name}.yaml").read_text())
                 .get("kernel_floor_s", 0.0))


def random_rows_unchanged(floor_s: float) -> bool:
    """The random-weight rows (experiments.clock_check's fixture) ran eagerly everywhere: each
    launching operation costs max(host_op_s, floor), which is host_op_s there."""
    from experiments import clock_check

    return floor_s <= clock_check.twin_rates(clock_check.load_records()).host_op_s


def check(twin_dir: Path = TWIN) -> dict:
    p = pairs(load_records(REAL), load_records(twin_dir))
    n = step_kernels()
    floor = fit(p, n)
    return {"pairs": p, "kernels": n, "floor_s": floor, "at_fit": predict(p, n, floor),
            "at_profile": predict(p, n, profile_floor())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--twin-records", type=Path, default=TWIN)
    ap.add_argument("--write-twin", type=Path, help="run the twin into this folder first")
    a = ap.parse_args(argv)
    twin = write_twin(a.write_twin) if a.write_twin else a.twin_records
    r = check(twin)
    f, n = r["floor_s"], r["kernels"]
    print(f"kernels a real-depth draft step: {n} (experiments.kernel_count, {COUNT.name})")
    print(f"fit: kernel_floor_s = {f * 1e6:.2f} us (the real draft windows over the twin's "
          f"roofline, {len(r['pairs'])} requests); profile h200_realsize: "
          f"{profile_floor() * 1e6:.2f} us")
    from experiments.clock_check import _fmt as fmt
    print("\nat the fit:\n" + fmt(r["at_fit"]))
    print("\nat the profile's floor:\n" + fmt(r["at_profile"]))
    for scale in (0.5, 2.0):
        err = predict(r["pairs"], n, f * scale)["draft_error"].abs().max()
        print(f"floor x {scale}: largest draft-window error {err:+.1%}")
    print(f"random-weight rows (eager) unchanged by the floor: {random_rows_unchanged(f)}")
    ok = (r["at_profile"]["draft_error"].abs() <= BAND).all()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
