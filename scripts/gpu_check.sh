#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU: the calibration of the virtual clock
# (scripts/calibrate_gpu.py, at most 8 minutes), the CUDA-marked tests, then a short benchmark
# in real CUDA time (hardware=cuda). Results go under $OUT (the device tool's output folder)
# or results/gpu_check/. Grows with each feature; keep its total run time within a few minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
# Stage limits in seconds (a lease is short: set them lower to fit, e.g. CAL_BUDGET_S=270).
CAL_BUDGET_S="${CAL_BUDGET_S:-420}"
TESTS_TIMEOUT_S="${TESTS_TIMEOUT_S:-120}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-240}"
[ -x "$PY" ] || PY=python3
status=0

{
  echo "# gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi missing"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} | tee "$OUT/env.txt"

# First, so its results exist even if a later stage runs out of device time: the measured
# hardware profile (launch, pinned H2D, HBM, GEMM, eager layer costs at the real shapes) and
# the virtual clock's error against real CUDA time (scripts/calibrate_gpu.py; --budget-s).
echo "== calibration: measured hardware profile, virtual clock vs real CUDA time" | tee "$OUT/calibration.txt"
timeout -k 20 $((CAL_BUDGET_S + 60)) "$PY" scripts/calibrate_gpu.py --out "$OUT/calibration" \
  --budget-s "$CAL_BUDGET_S" 2>&1 | tee -a "$OUT/calibration.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== CUDA-marked tests" | tee "$OUT/tests.txt"
timeout -k 10 "$TESTS_TIMEOUT_S" "$PY" -m pytest -q -m cuda tests 2>&1 | tee -a "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== pinned H2D bandwidth" | tee "$OUT/h2d.txt"
"$PY" - <<'PY' 2>&1 | tee -a "$OUT/h2d.txt"
import torch, time
for mb in (17, 64, 256):
    src = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print(f"{mb} MiB pinned H2D: {10 * (mb << 20) / (time.perf_counter() - t) / 1e9:.2f} GB/s")
PY

echo "== short benchmark: resident, lru, mo_sm, transformers, lru_s, specmoeoff, specter, sp_e on CUDA (real time), small DeepSeek-shaped model" | tee "$OUT/bench.txt"
timeout -k 10 "$BENCH_TIMEOUT_S" "$PY" run.py -m model="${MODEL:-small_deepseek}" system=resident,lru,mo_sm,transformers,lru_s,specmoeoff,specter,sp_e hardware=cuda dataset=gsm8k \
  workload.items=2 workload.repeats=2 workload.max_new_tokens=64 \
  out_dir="$OUT/records" progress=false 2>&1 | tee -a "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import sys
from experiments import records, summarize
df = records.load(sys.argv[1] + "/records")
if len(df):
    print(summarize.table(df).to_string(index=False))
PY
exit $status
