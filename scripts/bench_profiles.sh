#!/usr/bin/env bash
# The engine profiles' benchmark (not a timed test): the paper's five cases (DeepSeek high/low, Qwen
# high/low, Phi high; Phi's low budget resolves to the same 2 slots) on BOTH engine profiles
# of the modelled A100 (a100_pcie4_ideal: optimised engine; a100_pcie4_hf: eager framework),
# Specter beside SpecMoEOff, Transformers, LRU and resident, the virtual clock with the real
# models' sizes charged; plus Specter with the artifact's 32 staging buffers (DeepSeek high).
# Then the validation table (experiments.validate) on the same workload. Resumable.
# Usage: scripts/bench_profiles.sh [OUT_DIR] [ITEMS] [TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${1:-results/bench_profiles}"
ITEMS="${2:-3}" TOKENS="${3:-64}"
COMMON=(dataset=gsm8k hardware=a100_pcie4_ideal,a100_pcie4_hf out_dir="$OUT/cases" progress=false
        workload.repeats=1 workload.items="$ITEMS"
        workload.max_new_tokens="$TOKENS")
for case in "small_deepseek budget=high,low" "small_qwen budget=high,low" "small_phi budget=high"; do
  # shellcheck disable=SC2086
  "$PY" run.py -m "${COMMON[@]}" model=$case system=resident,lru,transformers,specmoeoff,specter
done
"$PY" run.py -m "${COMMON[@]}" model=small_deepseek budget=high system=specter budget.staging=32
"$PY" -m experiments.summarize "$OUT/cases" --short
"$PY" -m experiments.validate "$OUT/validate" --items "$ITEMS" --tokens "$TOKENS"
