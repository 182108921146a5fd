"""The kernel microbenchmark's timing harness: wall-clock calls on a CPU or a CUDA device.

Owns: the settings of a measuring run, the warm-up / timed-call loop (CUDA: events after a
synchronize), the --quick per-case time budget, percentiles, and the device's name.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from specter.hermetic import cpu_name


# ----------------------------------------------------------------------------------- cases
@dataclass
class Settings:
    device: torch.device
    device_name: str
    hardware: str  # "cpu" | "cuda"
    seed: int
    repeats: int
    warmup: int
    max_weight_gb: float
    target_dtype: torch.dtype
    quick: bool
    case_budget_s: float | None = None  # --quick: fewer timed calls for a slow case


# ----------------------------------------------------------------------------------- timing
def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of `repeats` calls after `warmup` calls (CUDA: events, synchronized)."""
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end))
        return out
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def once(fn, device: torch.device):
    """(fn(), its wall seconds), synchronized on CUDA: the correctness check's call, which
    is also the first warm-up call of the timing that follows."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def measure(fn, device: torch.device, check_s: float, s: "Settings") -> list[float]:
    """Timed calls of `fn` (ms) after the check's call (`check_s` seconds) and `warmup - 1`
    further warm-up calls. Under --quick a case stops at the timed calls that fit
    `case_budget_s` (at least one), judged by the last untimed call: one more is made when
    the check alone says the case is slow, since it may have paid a one-time cost (a JIT)."""
    warm, per_call = max(0, s.warmup - 1), check_s
    for i in range(warm):
        _, per_call = once(fn, device)
    repeats = s.repeats
    if s.case_budget_s is not None:
        if warm == 0 and per_call * repeats > s.case_budget_s:
            _, per_call = once(fn, device)
        repeats = max(1, min(repeats, int(s.case_budget_s / max(per_call, 1e-9))))
    return time_ms(fn, device, 0, repeats)


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# --------------------------------------------------------------------------------- devices
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
