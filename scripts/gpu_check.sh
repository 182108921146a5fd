#!/usr/bin/env bash
# One prepared check for a machine with a CUDA GPU. With no arguments it runs one stage,
# `default`, sized for five minutes on a lent H100 or H200 (experiments/gpu_check.py, one
# process): DeepSeek-V2-Lite at real size with trained routing (model=deepseek
# model.weights=inflated, built once), lru, specter, specter_hybrid and specmoeoff at
# budget.gb=16 and 24 and resident at budget=full, 3 gsm8k items x 64 tokens in real CUDA
# time, each system warmed by an untimed request; then the CUDA-marked tests. Budget-aware
# (CHECK_BUDGET_S, 300: it skips or cuts what does not fit, and writes what completed). Its
# table (OUT/default/gpu_check.md, .csv): TPOT, warm TPOT, draft ms a step, verification ms a
# window, kernels of each, hit rate, acceptance, MB over the link a token, link floor, TPOT
# over LRU's, and the predictions of docs/measurements/gpu-predictions.csv beside them.
#
# Every other stage runs only when named, in the order named: `STAGES=inflated,hotpath bash
# scripts/gpu_check.sh` or `bash scripts/gpu_check.sh inflated hotpath` (stages: default,
# inflated, tests, real_size, captured, hotpath, calibration, h2d, bench, hybrid; each is
# described above its function). GPU_CHECK_DRY_RUN=1 prints the stages it would run, in
# order, and runs none. Results go under $OUT (the device tool's output folder) or
# results/gpu_check/. CHECK_ARGS: more arguments for the default stage's driver (e.g.
# "--systems lru,specter --budgets 16").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_check}"
PY="${PY:-.venv/bin/python}"
# Stage limits in seconds (a lease is short: set them lower to fit, e.g. CAL_BUDGET_S=270).
CHECK_BUDGET_S="${CHECK_BUDGET_S:-300}"  # the default stage, its tests' share included
CAL_BUDGET_S="${CAL_BUDGET_S:-420}"
TESTS_TIMEOUT_S="${TESTS_TIMEOUT_S:-150}"  # the last run's took 149 s (H200)
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-240}"
HYBRID_TIMEOUT_S="${HYBRID_TIMEOUT_S:-150}"
REAL_SIZE_TIMEOUT_S="${REAL_SIZE_TIMEOUT_S:-300}"
INFLATED_TIMEOUT_S="${INFLATED_TIMEOUT_S:-480}"  # the sweep gets all but 2 x 50 + 100 + 90 s and the verdict's
HOTPATH_TIMEOUT_S="${HOTPATH_TIMEOUT_S:-180}"
CAPTURED_TIMEOUT_S="${CAPTURED_TIMEOUT_S:-360}"
# Which stages run, in the order named: the arguments, else STAGES (commas or spaces), else
# `default` alone.
if [ $# -gt 0 ]; then LIST="$*"; else LIST="${STAGES:-default}"; fi
LIST="${LIST//,/ }"
[ -x "$PY" ] || PY=python3
status=0

# The default stage (experiments/gpu_check.py, one process; its chain runs on the CPU in
# tests/test_gpu_check.py): the inflated DeepSeek-V2-Lite built once, lru, specter,
# specter_hybrid, specmoeoff at 16 and 24 GiB and resident at full in real CUDA time, each
# warmed by an untimed request, the sweep cut to its share of CHECK_BUDGET_S (rows that did
# not fit are skipped with a line; the table is rewritten after every job); then the
# CUDA-marked tests within TESTS_TIMEOUT_S. Table: $OUT/default/gpu_check.md and .csv.
stage_default() {
echo "== default: DeepSeek-V2-Lite real size (inflated), five systems x 16/24 GiB, real CUDA; CUDA tests" | tee "$OUT/default.txt"
# shellcheck disable=SC2086  # CHECK_ARGS: word-split on purpose
timeout -k 10 $((${CHECK_BUDGET_S%.*} + 30)) "$PY" -m experiments.gpu_check "$OUT/default" \
  --budget-s "$CHECK_BUDGET_S" --tests-timeout-s "$TESTS_TIMEOUT_S" ${CHECK_ARGS:-} 2>&1 \
  | tee -a "$OUT/default.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# Stage `inflated` (issue 45's question; the default stage asks it in one process): is Specter faster than LRU on a real GPU at real size, with a
# model that routes and drafts like a trained one? DeepSeek-V2-Lite at its real widths and
# depth (27 layers, 26.8 GiB of experts) inflated in memory from the shipped small_deepseek
# (model.weights=inflated, specter/models/inflate.py: no download, built on every core in
# about a minute, once for the whole sweep), in real CUDA time: specter, lru and specmoeoff at
# budget.gb=16 and 24, then specter at 16 GiB with K per window chosen with the slots and the
# link in view (spec.k=adaptive), then resident at budget=full, 3 gsm8k items x 64 tokens, RTN drafts;
# small_deepseek's own specter run on the same prompts (its acceptance beside the inflated
# model's); launches and syncs per committed token of specter and lru at 16 GiB
# (experiments.hotpath, 1 item x 17 tokens); the link floor at the H2D rate measured there.
# One process per part (scripts/real_size.sh; its chain runs on the CPU in
# tests/test_real_size.py). The table (experiments.real_size): TPOT (all requests, and all but
# the first), hit rate, hidden H2D, acceptance, MB over the link per token, link floor, TPOT
# over LRU's, launches and syncs per token, the host's us per launch. Sized for 8 minutes.
# INFLATED_VIRTUAL_HW=h200_realsize adds the virtual clock's twin of every job (the clock's
# held-out check on trained routing, experiments/clock_check.py; it does not fit in 8 minutes).
stage_inflated() {
echo "== inflated: DeepSeek-V2-Lite real size, trained routing (inflated from small_deepseek), real CUDA" | tee "$OUT/inflated.txt"
timeout -k 10 "$INFLATED_TIMEOUT_S" env PY="$PY" OUT="$OUT/inflated" MODEL=deepseek WEIGHTS=inflated \
  SWEEP_TIMEOUT_S=$((INFLATED_TIMEOUT_S - 310)) PART_TIMEOUT_S=50 HOTPATH_TIMEOUT_S=90 \
  RESIDENT_TIMEOUT_S=100 \
  SYSTEMS="${INFLATED_SYSTEMS:-specter,lru,specmoeoff}" BUDGET_GB="${INFLATED_BUDGET_GB:-16,24}" \
  ITEMS="${INFLATED_ITEMS:-3}" TOKENS="${INFLATED_TOKENS:-64}" VIRTUAL_HW="${INFLATED_VIRTUAL_HW:-none}" RESIDENT=1 ADAPTIVE=1 \
  SOURCE_CHECK=small_deepseek HOTPATH="${INFLATED_HOTPATH:-specter,lru}" \
  bash scripts/real_size.sh 2>&1 | tee -a "$OUT/inflated.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# A model larger
# than a 24 GB card, loaded as the loader now loads one: DeepSeek-V2-Lite at full depth (27
# layers, 15.7 B parameters, 29 GiB in fp16) with random weights (model.weights=random: no
# download; the 27 GiB of experts drawn on every core straight into pinned host memory, once
# for the whole sweep, and named by their seed rather than hashed), at a device budget of
# 24 GiB: lru and specter (RTN draft: GPTQ of random weights would only cost minutes) in real
# CUDA time (hardware=cuda) and on the h200_realsize virtual clock, 2 items x 24 tokens, one
# process (scripts/real_size.sh, the chain tests/test_real_size.py runs on the CPU; the runner
# frees each job's device memory before the next loads, so each load-time peak is its own).
# Sized for 5 minutes: about a minute to draw and pin the experts, the draft's quantization
# and save once, seconds per job to decode. Records only, then the verdict printed from them
# (every load-time device peak within its budget, else the stage fails; the virtual/real TPOT
# error table), which reruns anywhere: python -m experiments.real_size
# $OUT/real_size/records --real-hardware cuda. Optional: RESIDENT=1 (resident at budget=full,
# last: 29 GiB on the device), KERNEL_BENCH=1 (the INT4 backends at DeepSeek's shape first).
stage_real_size() {
echo "== real size: DeepSeek-V2-Lite full depth, random weights, budget.gb=24, real CUDA vs virtual" | tee "$OUT/real_size.txt"
timeout -k 10 "$REAL_SIZE_TIMEOUT_S" env PY="$PY" OUT="$OUT/real_size" \
  MODEL="${REAL_SIZE_MODEL:-deepseek}" bash scripts/real_size.sh 2>&1 | tee -a "$OUT/real_size.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# issue 36 item 5: the compiled steps captured as CUDA graphs (the compiled step over the
# static caches, captured whole by quant.kernels.capture_graph), eager against captured, counted per committed token
# (launches, syncs, graph replays; TPOT in the records) for resident (system.compile) and
# specter (spec.compile, gather_int4) at DeepSeek-V2-Lite's real sizes, random weights, 1 item
# x 24 tokens, real CUDA time. Each run compiles in the runner's untimed warm-up request
# (compile_warmup_s). The tables: $OUT/captured_{off,on}_{resident,specter}/hotpath.md.
stage_captured() {
echo "== captured: eager vs captured steps on CUDA, real sizes" | tee "$OUT/captured.txt"
CAP=(hardware=cuda model="${CAPTURED_MODEL:-deepseek}" model.weights=random workload.items=1
     workload.repeats=1 workload.max_new_tokens=24)
for c in off on; do
  for sys in resident specter; do
    knob=$([ "$sys" = resident ] && echo system.compile=$c || echo spec.compile=$c)
    echo "-- $sys $knob" | tee -a "$OUT/captured.txt"
    timeout -k 10 $((CAPTURED_TIMEOUT_S / 4)) "$PY" -m experiments.hotpath "$OUT/captured_${c}_$sys" \
      system=$sys "$knob" "${CAP[@]}" 2>&1 | grep -E "hotpath|error|Error" | tee -a "$OUT/captured.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
done
}

# What decoding issues on the GPU, counted exactly (a sync or a read counts only when its
# tensor is on the GPU, a blocking upload is a sync; host-side bookkeeping apart): aten ops,
# launches, syncs and host reads per phase per committed token, resident, lru, specmoeoff and
# specter on small_deepseek in real CUDA time (experiments/hotpath.py; the CPU's counts are an
# upper bound), with the draft's layers eager (quant.graphs=off) and then replayed as CUDA
# graphs (on), the draft step itself eager in both (spec.compile=off: by default the whole
# step is one captured graph, which the inflated stage measures): the records under each
# folder hold TPOT and draft/verify ms per window.
stage_hotpath() {
echo "== hot path: operations, launches and syncs per committed token on CUDA" | tee "$OUT/hotpath.txt"
# which dtypes torch's grouped GEMM takes here without a host sync (offload/grouped.py
# `pick_kernel` uses it for bfloat16 on compute capability 9.x/10.x, the padded bmm kernel
# elsewhere): runs or not, syncs or not (torch's sync debug mode), its largest difference from
# one GEMM per group, and the padded kernel's
"$PY" - <<'PROBE' 2>&1 | tee -a "$OUT/hotpath.txt"
import torch, torch.nn.functional as F
print("compute capability", torch.cuda.get_device_capability())
for dt in (torch.float16, torch.bfloat16, torch.float32):
    x, w = torch.randn(96, 2048, device="cuda", dtype=dt), torch.randn(16, 2816, 2048, device="cuda", dtype=dt)
    offs = torch.arange(6, 97, 6, device="cuda", dtype=torch.int32)
    ref = torch.cat([F.linear(x[6 * g:6 * g + 6], w[g]) for g in range(16)])
    pad = torch.bmm(x.view(16, 6, 2048), w.transpose(1, 2)).flatten(0, 1)
    try:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
            syncs = "no sync"
        except RuntimeError as e:
            torch.cuda.set_sync_debug_mode(0)
            y = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
            syncs = f"SYNCS ({str(e)[:60]})"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print(f"grouped_mm {dt}: runs, {syncs}, max |grouped - loop| = "
              f"{(y - ref).abs().max().item():.3g}; padded bmm: {(pad - ref).abs().max().item():.3g}")
    except Exception as e:
        print(f"grouped_mm {dt}: refused ({type(e).__name__}: {str(e)[:120]})")
PROBE
for graphs in off on; do
  echo "-- quant.graphs=$graphs" | tee -a "$OUT/hotpath.txt"
  timeout -k 10 $((HOTPATH_TIMEOUT_S / 2)) "$PY" -m experiments.hotpath "$OUT/hotpath_graphs_$graphs" \
    hardware=cuda quant.graphs=$graphs spec.compile=off workload.repeats=2 \
    model="${MODEL:-small_deepseek}" 2>&1 \
    | tee -a "$OUT/hotpath.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
# the counted profile refit on this GPU: the same code's counts and real TPOT (graphs off),
# its device-only TPOT on the virtual clock (h200_measured without host costs), held out;
# repeat 1 of 2 (repeat 0 is the CUDA warm-up)
timeout -k 10 120 "$PY" run.py -m system=resident,lru,specmoeoff,specter model="${MODEL:-small_deepseek}" \
  budget=high dataset=gsm8k workload.items=2 workload.repeats=1 workload.max_new_tokens=64 \
  quant.backend=gather_int4 hardware=h200_measured hardware.host_op_s=0 hardware.sync_s=0 \
  hardware.charge=own progress=false out_dir="$OUT/hotpath_device_only" 2>&1 | tail -n 3 | tee -a "$OUT/hotpath.txt"
"$PY" -m experiments.counted_fit --counts "$OUT/hotpath_graphs_off/hotpath.csv" \
  --zero "$OUT/hotpath_device_only" --real "$OUT/hotpath_graphs_off/records" --source '' \
  --repeat 1 --out "$OUT/hotpath_fit" 2>&1 | tee -a "$OUT/hotpath.txt"
# the waits a window makes on this GPU (tests/test_gpu_waits.py, the real torch.cuda patched to
# log them): device-wide syncs, host waits on the copy stream, what the copy stream waits on
echo "-- waits per window (specter, specmoeoff, lru_s, lru on tiny_deepseek)" | tee -a "$OUT/hotpath.txt"
timeout -k 10 120 "$PY" -m pytest -q -s -m cuda tests/test_gpu_waits.py 2>&1 | tail -n 12 \
  | tee -a "$OUT/hotpath.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

stage_calibration() {
echo "== calibration: measured hardware profile, virtual clock vs real CUDA time" | tee "$OUT/calibration.txt"
timeout -k 20 $((CAL_BUDGET_S + 60)) "$PY" scripts/calibrate_gpu.py --out "$OUT/calibration" \
  --budget-s "$CAL_BUDGET_S" 2>&1 | tee -a "$OUT/calibration.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

stage_tests() {
echo "== CUDA-marked tests" | tee "$OUT/tests.txt"
timeout -k 10 "$TESTS_TIMEOUT_S" "$PY" -m pytest -q -m cuda -rA tests 2>&1 | tee -a "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

stage_h2d() {
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
}

stage_bench() {
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
}

stage_hybrid() {
# Host-computed misses beside a real GPU: this machine's host CPU rates (conf/host/measured.yaml
# in this copy), then resident, lru, lru_hybrid, specter, specter_hybrid in real CUDA time with
# the measured profile's rates deciding (hardware.clock=wall), and the tokens that differ from
# resident's (the host computes in fp32, the GPU in fp16). A second run makes the decision's
# link slow (1 GB/s) so that most misses go to the host: the agreement count covers them.
echo "== host-computed misses on CUDA: host rate, TPOT, tokens differing from resident" | tee "$OUT/hybrid.txt"
timeout -k 10 "$HYBRID_TIMEOUT_S" bash -c '
  "$0" -m experiments.host_rate --write &&
  "$0" run.py -m model="${MODEL:-small_deepseek}" system=resident,lru,lru_hybrid,specter,specter_hybrid \
    hardware=h200_measured hardware.clock=wall host=measured budget=high,low dataset=gsm8k \
    workload.items=2 workload.repeats=2 workload.max_new_tokens=64 out_dir="$1/hybrid" progress=false &&
  "$0" run.py -m model="${MODEL:-small_deepseek}" system=resident,lru_hybrid,specter_hybrid \
    hardware=h200_measured hardware.clock=wall host=measured hardware.h2d_bandwidth_Bps=1e9 \
    budget=low dataset=gsm8k workload.items=2 workload.max_new_tokens=64 \
    out_dir="$1/hybrid_forced" progress=false' "$PY" "$OUT" 2>&1 | tee -a "$OUT/hybrid.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for d in hybrid hybrid_forced; do
  [ -d "$OUT/$d" ] || continue
  { echo "-- $d"; "$PY" -m experiments.summarize "$OUT/$d" --short
    "$PY" -m experiments.summarize "$OUT/$d" --agreement; } 2>&1 | tee -a "$OUT/hybrid.txt"
done
}
for s in $LIST; do
  declare -F "stage_$s" >/dev/null || {
    echo "error: unknown stage '$s'; choose from: default inflated tests real_size captured hotpath calibration h2d bench hybrid" >&2
    exit 2; }
done
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
  for s in $LIST; do echo "stage $s"; done
  exit 0
fi
mkdir -p "$OUT"
{
  echo "# gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null) stages: $LIST"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi missing"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} | tee "$OUT/env.txt"
for s in $LIST; do "stage_$s"; done
exit $status
