"""This machine's host rates for host-computed experts: FP32 GEMM FLOP/s and the bandwidth at
which an expert's weights stream through a matrix-vector product, at DeepSeek-V2-Lite's expert
shape (hidden 2048, intermediate 1408), measured with torch on the CPU.

    python -m experiments.host_rate                 # print
    python -m experiments.host_rate --write         # and write conf/host/measured.yaml

`host=measured` then charges host-computed experts at these rates on the virtual clock (the
host side calibrated on this machine rather than assumed). Best of several repeats; the
machine, its cores and torch's threads go into the file's header.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

HIDDEN, INTER = 2048, 1408
OUT = Path(__file__).resolve().parents[1] / "conf" / "host" / "measured.yaml"


def _best(fn, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def measure(repeats: int = 7, tokens: int = 256) -> dict:
    """FP32 FLOP/s of an expert's gate_up GEMM over `tokens` tokens, and bytes/s of its
    weights in a one-token matrix-vector product (memory-bound: the weights stream once)."""
    w = torch.randn(2 * INTER, HIDDEN)
    x = torch.randn(tokens, HIDDEN)
    gemm_s = _best(lambda: torch.nn.functional.linear(x, w), repeats)
    flops = 2.0 * tokens * HIDDEN * 2 * INTER / gemm_s
    weights = [torch.randn(2 * INTER, HIDDEN) for _ in range(8)]  # 8 experts: past the caches
    v = torch.randn(1, HIDDEN)
    gemv_s = _best(lambda: [torch.nn.functional.linear(v, m) for m in weights], repeats)
    bandwidth = sum(m.numel() * m.element_size() for m in weights) / gemv_s
    return {"host_matrix_flops": flops, "host_mem_bandwidth_Bps": bandwidth,
            "threads": torch.get_num_threads(), "gemm_tokens": tokens}


def cpu_name() -> str:
    from experiments.kernel_timing import device_name

    return device_name(torch.device("cpu"))


def as_yaml(m: dict) -> str:
    return (f"# @package hardware\n"
            f"# Measured on this machine by `python -m experiments.host_rate --write`: {cpu_name()},\n"
            f"# {os.cpu_count()} logical CPUs, torch {torch.__version__} with {m['threads']} threads,\n"
            f"# on {time.strftime('%Y-%m-%d')}. FP32 GEMM of one expert's gate_up ({m['gemm_tokens']} tokens x\n"
            f"# {HIDDEN} x {2 * INTER}) and one-token GEMVs over 8 experts' weights (DeepSeek-V2-Lite shape).\n"
            f"host: measured\n"
            f"host_matrix_flops: {m['host_matrix_flops']:.4g}\n"
            f"host_mem_bandwidth_Bps: {m['host_mem_bandwidth_Bps']:.4g}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.host_rate", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(OUT.parents[2])}")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    m = measure(args.repeats)
    print(f"host FP32 GEMM {m['host_matrix_flops'] / 1e9:.1f} GFLOP/s, expert weights streamed at "
          f"{m['host_mem_bandwidth_Bps'] / 1e9:.2f} GB/s ({m['threads']} threads, {cpu_name()})")
    if args.write:
        OUT.write_text(as_yaml(m))
        print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
