#!/usr/bin/env bash
# Routing fidelity of the INT4 self-draft : the small models of the three paper
# architectures x {GPTQ, RTN} x {2, 3, 4, 8} bits, plus gptqmodel's GPTQ at 4 bits, on the
# artifact workload's five datasets (first 5 items, 16 prompt tokens, 128 new tokens).
# Resumable; prints the table. Usage: scripts/fidelity.sh [OUT_DIR] [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${1:-results/fidelity}"; shift || true
MODELS="${MODELS:-small_deepseek,small_qwen,small_phi}"
DATASETS="${DATASETS:-gsm8k,wikitext2,humaneval,gpqa,c4}"
COMMON=(experiment=fidelity model="$MODELS" dataset="$DATASETS" out_dir="$OUT" progress=false "$@")
"$PY" run.py -m "${COMMON[@]}" quant.method=gptq,rtn quant.bits=2,3,4,8
if "$PY" -c "import gptqmodel" 2>/dev/null; then
  "$PY" run.py -m "${COMMON[@]}" quant.method=gptqmodel quant.bits=4
else
  echo "gptqmodel not installed: its row is skipped (make setup installs it)" >&2
fi
"$PY" -m experiments.fidelity_table "$OUT" --csv "$OUT/fidelity_table.csv"
