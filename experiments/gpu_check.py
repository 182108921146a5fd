"""The GPU check's default stage (scripts/gpu_check.sh with no arguments): one process, one
answer in five minutes on a lent H100 or H200.

DeepSeek-V2-Lite's real size with trained routing (`model=deepseek model.weights=inflated`,
specter/models/inflate.py, as scripts/real_size.sh runs it), in real CUDA time
(`hardware=cuda`): lru, specter, specter_hybrid and specmoeoff at budget.gb=16 and 24, every
system at the first budget before any at the next, then resident at budget=full (it puts
every expert on the device, so a budget in GiB does not apply to it); 3 gsm8k items x 64 new
tokens, one repeat, RTN drafts. Every job runs through the runner in this one process
(experiments/runner.py `run`), so the inflated host store is made and pinned once for all of
them (placement/loader.py `_made_store`), the RTN draft is quantized and saved once, and a
compiled step that the next job compiles again finds inductor's caches warm; on a GPU the
runner times every system warm (compose.warm_up: one short untimed request before the timed
ones). specter_hybrid decides host-computed misses from a profile's rates, which
`hardware=cuda` lacks: on a real clock it runs as `hardware=h200_measured
hardware.clock=wall` (real CUDA time, the measured H200 profile's rates deciding).
Then the CUDA-marked tests (pytest -m cuda, in a subprocess).

Budget-aware: `--budget-s` (300) bounds the whole, the tests keep their `--tests-timeout-s`
(150) of it; a job that would start with less than `--min-job-s` left of the sweep's share is
skipped with a printed line, and one still running at the sweep's deadline is cut (SIGALRM;
the rows it wrote are kept). The table is rewritten from the records after every job, so
what completed is always under OUT.

The table (OUT/gpu_check.md and OUT/gpu_check.csv), per system x budget:
TPOT and warm TPOT (every request but the first), draft ms a step, verification ms a
window, kernels a draft step and a verification window (record fields `kernels.draft_step`,
`kernels.verify_window`, "-" where the records lack them), hit rate, acceptance, MB over the
link a committed token, the link floor at the H2D rate measured here, and TPOT over LRU's at
the same budget (experiments/real_size.py `stage_table` computes these from the records);
beside them the predictions for this GPU from docs/measurements/gpu-predictions.csv
(`gpu,system,budget_gb,tpot_ms,warm_tpot_ms,draft_ms_step,verify_ms_window,clock_commit,
note`; gpu "H100" or "H200", matched in torch.cuda.get_device_name) and real / predicted.

    python -m experiments.gpu_check OUT [--budget-s 300] [--systems a,b] [--budgets 16,24]
        [--items 3] [--tokens 64] [--model deepseek] [--weights inflated] [--hardware cuda]
        [--gpu H100] [--h2d-gbps R] [--no-tests] [--tests-timeout-s 150] [run.py overrides]

On the CPU (tests/test_gpu_check.py) the same driver runs with a tiny model on a virtual
clock: `--model tiny_deepseek --weights checkpoint --hardware a100_pcie4_hf --items 1
--tokens 8 --systems lru,specter --no-tests`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
PREDICTIONS = REPO / "docs" / "measurements" / "gpu-predictions.csv"
PREDICTION_COLUMNS = ("gpu", "system", "budget_gb", "tpot_ms", "warm_tpot_ms", "draft_ms_step",
                      "verify_ms_window", "clock_commit", "note")
# what a prediction names -> the table's real column it is compared with
PREDICTED = {"tpot_ms": "tpot_ms", "warm_tpot_ms": "tpot_ms_after_first",
             "draft_ms_step": "draft_ms_step", "verify_ms_window": "verify_ms_window"}
GPUS = ("H200", "H100")  # the kinds a prediction can name, as get_device_name spells them
SYSTEMS = ("lru", "specter", "specter_hybrid", "specmoeoff", "resident")
BUDGETS = ("16", "24")
REAL_HW = "cuda"
# host-computed misses decide from a profile's rates: on a real clock, the measured H200's
HYBRID_ON_REAL = ("hardware=h200_measured", "hardware.clock=wall")
HYBRID = ("lru_hybrid", "specter_hybrid")


@dataclass(frozen=True)
class Job:
    system: str
    budget: str  # GiB, or "full"

    @property
    def label(self) -> str:
        return f"{self.system} @ {'full' if self.budget == 'full' else self.budget + ' GiB'}"

    def overrides(self, hardware: str) -> list[str]:
        budget = ["budget=full"] if self.budget == "full" else ["budget=gb",
                                                               f"budget.gb={self.budget}"]
        hw = (list(HYBRID_ON_REAL) if self.system in HYBRID and hardware == REAL_HW
              else [f"hardware={hardware}"])
        return [f"system={self.system}", *budget, *hw]


def jobs(systems, budgets) -> list[Job]:
    """Every system at the first budget before any at the next (a sweep cut by its deadline
    still compares them), resident once at budget=full, last."""
    out = [Job(s, b) for b in budgets for s in systems if s != "resident"]
    if "resident" in systems:
        out.append(Job("resident", "full"))
    return out


def base_overrides(model: str, weights: str, items: int, tokens: int, out: Path,
                   extra=()) -> list[str]:
    """What every job shares (as scripts/real_size.sh's sweep): the model, gsm8k, items x
    tokens, one repeat, an RTN draft, records under OUT/records."""
    return [f"model={model}", f"model.weights={weights}", "dataset=gsm8k",
            f"workload.items={items}", "workload.repeats=1", f"workload.max_new_tokens={tokens}",
            "quant.method=rtn", "progress=false", f"out_dir={Path(out) / 'records'}", *extra]


# ---- predictions -------------------------------------------------------------------------

def gpu_kind(name: str | None) -> str | None:
    """"H100" or "H200" from a device name (torch.cuda.get_device_name), else None."""
    if not name:
        return None
    return next((g for g in GPUS if g.lower() in name.lower()), None)


def budget_key(value) -> str:
    """A budget as experiments/real_size.py names it: "16 GiB", or "full"."""
    if value is None or (isinstance(value, float) and math.isnan(value)) \
            or str(value).strip().lower() in ("", "full", "nan"):
        return "full"
    return f"{float(value):g} GiB"


def read_predictions(path: Path = PREDICTIONS, gpu: str | None = None) -> pd.DataFrame:
    """The predictions csv, one row per (system, budget_key) of `gpu` (all GPUs when None),
    with the numbers as floats and the columns `pred_<name>`. A missing file, or one with the
    header only: an empty frame."""
    cols = ["gpu", "system", "budget_key", *(f"pred_{c}" for c in PREDICTED), "clock_commit",
            "note"]
    if not Path(path).is_file():
        return pd.DataFrame(columns=cols)
    df = pd.read_csv(path, dtype={"gpu": str, "system": str, "clock_commit": str, "note": str},
                     keep_default_na=False, na_values={c: [""] for c in PREDICTED})
    missing = [c for c in PREDICTION_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
    df["gpu"] = df["gpu"].str.strip().str.upper()
    if gpu is not None:
        df = df[df["gpu"] == gpu.upper()]
    df = df.assign(budget_key=df["budget_gb"].map(budget_key), system=df["system"].str.strip())
    for c in PREDICTED:
        df[f"pred_{c}"] = pd.to_numeric(df[c], errors="coerce")
    return df[cols].drop_duplicates(["gpu", "system", "budget_key"], keep="last")


# ---- the table -----------------------------------------------------------------------------

def _extra(g: pd.DataFrame) -> pd.Series:
    """What stage_table does not compute: the draft's ms a step (all windows' draft time over
    all their steps), verification's ms a window, and the kernels the records count."""
    def weighted(num: str, den: str) -> float:
        if num not in g or den not in g or "windows" not in g:
            return math.nan
        ok = g[[num, den, "windows"]].apply(pd.to_numeric, errors="coerce").dropna()
        steps = (ok[den] * ok["windows"]).sum()
        return (ok[num] * ok["windows"]).sum() / steps if steps else math.nan

    def mean(col: str) -> float:
        return pd.to_numeric(g[col], errors="coerce").mean() if col in g else math.nan

    return pd.Series({"draft_ms_step": weighted("draft_ms_per_window", "k_window_mean"),
                      "verify_ms_window": mean("verify_ms_per_window"),
                      "kernels_draft_step": mean("kernels.draft_step"),
                      "kernels_verify_window": mean("kernels.verify_window")})


def table(df: pd.DataFrame, real_hardware: str | None = None, h2d_gbps: float | None = None,
          predictions: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per system x budget: experiments/real_size.py's stage table (TPOT, warm TPOT, hit rate,
    acceptance, MB over the link, link floor, over LRU), the draft's and verification's times
    and kernels, and the predictions beside them with real / predicted."""
    from experiments.real_size import _budget_key, stage_table

    if df.empty:
        return pd.DataFrame()
    t = stage_table(df, real_hardware, h2d_gbps)
    rows = df.assign(budget_key=df["budget_gb"].map(_budget_key))
    extra = rows.groupby(["system", "budget_key"]).apply(_extra, include_groups=False)
    t = t.merge(extra.reset_index(), on=["system", "budget_key"], how="left")
    p = predictions if predictions is not None else pd.DataFrame()
    p = p[[c for c in p.columns if c == "system" or c == "budget_key" or c.startswith("pred_")]]
    if p.empty:
        p = pd.DataFrame(columns=["system", "budget_key", *(f"pred_{c}" for c in PREDICTED)])
    t = t.merge(p, on=["system", "budget_key"], how="left")
    for name, real in PREDICTED.items():
        t[f"{name}_over_pred"] = pd.to_numeric(t[real], errors="coerce") / \
            pd.to_numeric(t[f"pred_{name}"], errors="coerce")
    return t


SHOWN = [("system", "system"), ("budget_key", "budget"), ("slots", "slots"),
         ("requests", "req"), ("tpot_ms", "TPOT ms"), ("tpot_ms_after_first", "warm TPOT ms"),
         ("draft_ms_step", "draft ms/step"), ("verify_ms_window", "verify ms/window"),
         ("kernels_draft_step", "kernels/draft step"),
         ("kernels_verify_window", "kernels/verify window"), ("hit_rate", "hit rate"),
         ("acceptance", "acceptance"), ("h2d_MB_per_token", "MB/token over link"),
         ("link_floor_ms", "link floor ms"), ("pred_tpot_ms", "pred TPOT ms"),
         ("tpot_ms_over_pred", "TPOT/pred"), ("pred_warm_tpot_ms", "pred warm ms"),
         ("warm_tpot_ms_over_pred", "warm/pred"), ("pred_draft_ms_step", "pred draft ms"),
         ("draft_ms_step_over_pred", "draft/pred"), ("pred_verify_ms_window", "pred verify ms"),
         ("verify_ms_window_over_pred", "verify/pred"), ("over_lru", "x LRU")]


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def markdown(t: pd.DataFrame) -> str:
    """The table's shown columns as a markdown table, "-" where a value is missing."""
    cols = [(c, h) for c, h in SHOWN if c in t.columns]
    lines = ["| " + " | ".join(h for _, h in cols) + " |",
             "| " + " | ".join("---" if c in ("system", "budget_key") else "---:"
                               for c, _ in cols) + " |"]
    for _, r in t.iterrows():
        lines.append("| " + " | ".join(_cell(r[c]) for c, _ in cols) + " |")
    return "\n".join(lines)


def write_table(out: Path, real_hardware: str | None, h2d_gbps: float | None,
                predictions: pd.DataFrame, log=print, show: bool = False) -> pd.DataFrame:
    from experiments import records

    df = records.load(out / "records", warn=lambda m: log(f"warning: {m}"))
    t = table(df, real_hardware, h2d_gbps, predictions)
    if t.empty:
        (out / "gpu_check.md").write_text("no rows yet\n")
        return t
    t.to_csv(out / "gpu_check.csv", index=False)
    md = markdown(t)
    (out / "gpu_check.md").write_text(md + "\n")
    if show:
        print(md)
    return t


# ---- the run -------------------------------------------------------------------------------

class OutOfTime(BaseException):
    """Raised by SIGALRM in a job still running at the sweep's deadline (a BaseException, so
    no `except Exception` inside the job swallows it; the runner frees the job and re-raises)."""


@contextlib.contextmanager
def deadline(seconds: float):
    """SIGALRM after `seconds` raises OutOfTime here (main thread only; elsewhere no limit)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def ring(*_):
        raise OutOfTime

    try:
        old = signal.signal(signal.SIGALRM, ring)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def measure_h2d_gbps() -> float | None:
    """Pinned host-to-device GB/s (256 MiB copies, as scripts/real_size.sh measures it); None
    without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    b.record()
    torch.cuda.synchronize()
    gbps = 4 * src.numel() / (a.elapsed_time(b) / 1e3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbps


def device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def release_held_store() -> None:
    """Free the inflated host store the loader keeps for a next job (before the tests run in
    their own process)."""
    from specter import compose
    from specter.placement import loader

    loader._LAST_RANDOM_STORE.clear()
    compose.free()


def run_tests(out: Path, timeout_s: float, args: list[str]) -> bool:
    """pytest -m cuda in a subprocess, its output in OUT/tests.txt, the tail printed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rA", *args]
    print(f"== CUDA-marked tests ({' '.join(cmd[1:])}; timeout {timeout_s:.0f} s)", flush=True)
    log = out / "tests.txt"
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        text, ok = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as e:
        text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                else (e.stdout or "")) + f"\nTIMEOUT after {timeout_s:.0f} s\n"
        ok = False
    log.write_text(text)
    print("\n".join(text.rstrip().splitlines()[-15:]), flush=True)
    return ok


KEPT = ("[specter] loaded", "[specter] compiled step", "[specter] engine warmed",
        "[specter] wrote", "[specter] hardware=", "[specter] resuming")


def main(argv: list[str] | None = None) -> int:
    from experiments import runner
    from specter.errors import UserError
    from specter.settings import run_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="the whole check's seconds, the tests' share included (default 300)")
    ap.add_argument("--tests-timeout-s", type=float, default=150.0)
    ap.add_argument("--no-tests", action="store_true", help="skip the CUDA-marked tests")
    ap.add_argument("--tests-args", default="tests", help="pytest's paths (default: tests)")
    ap.add_argument("--min-job-s", type=float, default=10.0,
                    help="skip a job that would start with less than this left (default 10)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--budgets", default=",".join(BUDGETS), help="budget.gb values")
    ap.add_argument("--items", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="deepseek")
    ap.add_argument("--weights", default="inflated")
    ap.add_argument("--hardware", default=REAL_HW)
    ap.add_argument("--gpu", default=None, help="H100 or H200 (default: from the device name)")
    ap.add_argument("--h2d-gbps", type=float, default=None,
                    help="the link's rate for the floor (default: measured here on CUDA)")
    ap.add_argument("--predictions", type=Path, default=PREDICTIONS)
    args, extra = ap.parse_known_args(argv)
    began = time.monotonic()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tests_share = 0.0 if args.no_tests else args.tests_timeout_s
    sweep_end = began + args.budget_s - tests_share - 5.0  # 5 s: the table, the tests' start
    logfile = (out / "runs.log").open("a")

    def log(*parts) -> None:
        line = " ".join(str(p) for p in parts)
        logfile.write(line + "\n")
        logfile.flush()
        if line.startswith(KEPT) or line.startswith("error"):
            print("   " + line, flush=True)

    name = device_name()
    gpu = (args.gpu or gpu_kind(name) or "").upper() or None
    predictions = read_predictions(args.predictions, gpu)
    print(f"[gpu_check] device {name or 'none (CPU)'}; predictions: {len(predictions)} row(s) "
          f"for {gpu or 'no GPU kind'} in {args.predictions}", flush=True)
    h2d = args.h2d_gbps if args.h2d_gbps is not None else measure_h2d_gbps()
    if h2d:
        print(f"[gpu_check] pinned H2D {h2d:.1f} GB/s (the link floor's rate)", flush=True)
    real_hw = None if args.hardware == REAL_HW else args.hardware
    base = base_overrides(args.model, args.weights, args.items, args.tokens, out, extra)
    todo = jobs([s for s in args.systems.split(",") if s],
                [b for b in args.budgets.split(",") if b])
    status = 0
    for i, job in enumerate(todo):
        left = sweep_end - time.monotonic()
        if left < args.min_job_s:
            for j in todo[i:]:
                print(f"[gpu_check] SKIPPED {j.label}: out of time ({max(left, 0):.0f} s left "
                      f"of the sweep's {args.budget_s - tests_share:.0f})", flush=True)
            break
        t0 = time.monotonic()
        print(f"[gpu_check] {job.label} ({left:.0f} s left)", flush=True)
        try:
            with deadline(left):
                summary = runner.run(run_config([*base, *job.overrides(args.hardware)]), log=log)
            print(f"[gpu_check] {job.label}: {summary.written} row(s), mean TPOT "
                  f"{summary.tpot_ms_mean:.2f} ms, {time.monotonic() - t0:.0f} s", flush=True)
        except OutOfTime:
            print(f"[gpu_check] CUT {job.label} at the sweep's deadline after "
                  f"{time.monotonic() - t0:.0f} s (its rows written so far are kept)", flush=True)
        except UserError as e:
            status = 1
            print(f"[gpu_check] FAILED {job.label}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 (one job's failure: the others still run)
            status = 1
            print(f"[gpu_check] FAILED {job.label}: {type(e).__name__}: {e}", flush=True)
        write_table(out, real_hw, h2d, predictions, log)
    print(f"[gpu_check] sweep done in {time.monotonic() - began:.0f} s; the table "
          f"({out / 'gpu_check.md'}, .csv):", flush=True)
    t = write_table(out, real_hw, h2d, predictions, log, show=True)
    if t.empty:
        print("[gpu_check] no rows", flush=True)
        status = 1
    if not args.no_tests:
        release_held_store()
        left = began + args.budget_s - time.monotonic()
        if left < 10:
            print(f"[gpu_check] SKIPPED the CUDA-marked tests: out of time ({left:.0f} s left)")
            status = 1
        elif not run_tests(out, min(args.tests_timeout_s, left), args.tests_args.split()):
            status = 1
    print(f"[gpu_check] done in {time.monotonic() - began:.0f} s", flush=True)
    logfile.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
