#!/usr/bin/env bash
# Specter's benchmark (not a timed test): every system side by side on the three small
# project-made models (DeepSeek-, Qwen- and Phi-shaped), modelled A100 + PCIe 4.0 x16, high
# and low budgets, under the virtual clock with the real models' sizes charged; then a short
# emulated (wall-clock) check on the DeepSeek-shaped model. Resumable; one table at the end.
# Usage: scripts/bench_specter.sh [OUT_DIR] [extra run.py overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${1:-results/bench_specter}"; shift || true
SYSTEMS=resident,lru,mo_sm,quasi_hidden,transformers,lru_s,specmoeoff,specmoe,sp_e,sp_l,specter
COMMON=(dataset=gsm8k hardware=a100_pcie4_hf hardware.charge=real out_dir="$OUT" progress=false
        workload.repeats=1 "$@")  # the virtual clock is deterministic: one repeat
for model in small_deepseek small_qwen small_phi; do
  "$PY" run.py -m "${COMMON[@]}" model=$model system=$SYSTEMS budget=high,low \
    workload.items=3 workload.max_new_tokens=64
done
"$PY" run.py -m "${COMMON[@]}" model=small_deepseek system=resident,lru_s,specmoeoff,specter \
  budget=high hardware.clock=emulated workload.items=1 workload.max_new_tokens=32
"$PY" -m experiments.summarize "$OUT"
