#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU: the CUDA-marked tests, then a short
# benchmark. Results go under $OUT (the device tool's output folder) or results/gpu_check/.
# Grows with each feature; keep its total run time within a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
status=0

{
  echo "# gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi missing"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} | tee "$OUT/env.txt"

echo "== CUDA-marked tests" | tee "$OUT/tests.txt"
"$PY" -m pytest -q -m cuda tests 2>&1 | tee -a "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== short benchmark: resident on CUDA, tiny and small DeepSeek-shaped models" | tee "$OUT/bench.txt"
for model in tiny_deepseek small_deepseek; do
  "$PY" run.py model=$model system=resident hardware=cuda dataset=gsm8k \
    workload.items=2 workload.repeats=1 workload.max_new_tokens=64 \
    out_dir="$OUT/records" progress=false 2>&1 | tee -a "$OUT/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
"$PY" - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import sys
from experiments import records
df = records.load(sys.argv[1] + "/records")
if len(df):
    print(df.groupby(["model", "system", "device"])[["tpot_ms", "ttft_ms", "peak_mem_bytes"]].mean().to_string())
PY
exit $status
