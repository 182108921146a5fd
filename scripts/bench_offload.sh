#!/usr/bin/env bash
# Offloading baselines side by side (a benchmark, not a timed test):
# small DeepSeek-shaped model, modelled A100 + PCIe 4.0 x16, high and low budgets,
# resident / lru / mo_sm / transformers under the virtual clock with the model's own sizes and with
# DeepSeek-V2-Lite's sizes charged, then the emulated (wall-clock) check. Resumable.
# The emulated check is shorter (2 items, 32 tokens): its transfers really sleep.
# Usage: scripts/bench_offload.sh [OUT_DIR] [extra run.py overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${1:-results/bench_offload}"; shift || true
COMMON=(model=small_deepseek dataset=gsm8k hardware=a100_pcie4_hf out_dir="$OUT" progress=false "$@")
"$PY" run.py -m "${COMMON[@]}" system=resident,lru,mo_sm,transformers budget=high,low hardware.charge=own,real
"$PY" run.py -m "${COMMON[@]}" system=resident,lru,mo_sm,transformers budget=high hardware.charge=real \
  hardware.clock=emulated workload.repeats=1 workload.items=2 workload.max_new_tokens=32
"$PY" -m experiments.summarize "$OUT"
