#!/usr/bin/env bash
# The real-size stage's command chain, in one place: scripts/gpu_check.sh stage `real_size`
# runs it on a GPU with the defaults below; tests/test_real_size.py runs the same chain on the
# CPU with a tiny project-made model, so a GPU lease is not spent finding a typo.
#
# One `run.py -m` sweep in one process (the random host store is drawn, pinned and
# checksummed once for every job; the runner frees each job's device memory before the next
# loads): SYSTEMS x (REAL_HW, VIRTUAL_HW) at budget=gb budget.gb=BUDGET_GB with an RTN draft,
# ITEMS items x TOKENS new tokens, one repeat. Then, optionally (RESIDENT=1), resident at
# budget=full last (it puts the whole model on the device: 29 GiB for DeepSeek-V2-Lite).
# Records go to $OUT/records; the verdict (experiments/real_size.py: load-time device peaks
# against the budget, virtual/real TPOT error table) is printed at the end from them and can
# be rerun anywhere: python -m experiments.real_size $OUT/records --real-hardware cuda.
#
#   MODEL        deepseek        model=...
#   WEIGHTS      random          model.weights=... (random: the published config, no download;
#                                inflated: the published sizes grown from small_deepseek, routing
#                                and drafting like it, models/inflate.py; checkpoint for a
#                                project-made model)
#   REAL_HW      cuda            the real side (hardware=cuda: real CUDA time, clock "cuda")
#   VIRTUAL_HW   h200_realsize   the virtual side (its virtual clock at the same sizes; none: no
#                                virtual side, the real one only)
#   BUDGET_GB    24              budget=gb budget.gb=...
#   SYSTEMS      lru,specter     system=...
#   QUANT        rtn             quant.method=... (GPTQ of random weights would cost minutes)
#   ITEMS        2               workload.items=...
#   TOKENS       24              workload.max_new_tokens=...
#   RESIDENT     0               1: resident at budget=full after the sweep (optional, last)
#   ADAPTIVE     0               1: then specter with K chosen per window, the slots and the
#                                link in view (spec.k=adaptive), at the first budget
#   KERNEL_BENCH 0               1: first the INT4 draft backends at DeepSeek's expert shape
#                                (experiments.kernel_bench --quick --tokens 1 --write-choice:
#                                quant.backend=auto then takes the fastest measured)
#   SOURCE_CHECK (none)          a project-made model (e.g. small_deepseek) run as specter on the
#                                same prompts, REAL_HW, budget=high: its acceptance beside the
#                                inflated model's (the verdict prints both)
#   HOTPATH      (none)          systems whose launches and syncs per committed token are counted
#                                at the first budget (experiments.hotpath, 1 item x 17 tokens)
#   H2D_GBPS     (measured)      the link's rate for the link floor (default: measured here, one
#                                256 MiB pinned copy on CUDA; none on the CPU)
#   SWEEP_TIMEOUT_S  (none)      a time limit for the sweep, and PART_TIMEOUT_S for each later
#   PART_TIMEOUT_S   (none)      part (resident, source, hot path), so that the verdict always
#                                prints from what finished (rows are written per request);
#   HOTPATH_TIMEOUT_S (PART's)   the hot path's own (its specter compiles and captures again)
#   RESIDENT_TIMEOUT_S (PART's)  resident's own (on CUDA its decode step compiles and is
#                                captured in the untimed warm-up, as the draft's is)
#   EXTRA        (none)          more run.py overrides for every job, space-separated
#   OUT          results/real_size
#   PY           .venv/bin/python
# Exit status: 1 when a part failed or the verdict failed (a peak above its budget, or nothing
# paired), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-deepseek}"
WEIGHTS="${WEIGHTS:-random}"
REAL_HW="${REAL_HW:-cuda}"
VIRTUAL_HW="${VIRTUAL_HW:-h200_realsize}"
BUDGET_GB="${BUDGET_GB:-24}"
SYSTEMS="${SYSTEMS:-lru,specter}"
QUANT="${QUANT:-rtn}"
ITEMS="${ITEMS:-2}"
TOKENS="${TOKENS:-24}"
RESIDENT="${RESIDENT:-0}"
ADAPTIVE="${ADAPTIVE:-0}"
KERNEL_BENCH="${KERNEL_BENCH:-0}"
SOURCE_CHECK="${SOURCE_CHECK:-}"
HOTPATH="${HOTPATH:-}"
H2D_GBPS="${H2D_GBPS:-}"
SWEEP_TIMEOUT_S="${SWEEP_TIMEOUT_S:-}"
PART_TIMEOUT_S="${PART_TIMEOUT_S:-}"
HOTPATH_TIMEOUT_S="${HOTPATH_TIMEOUT_S:-$PART_TIMEOUT_S}"
RESIDENT_TIMEOUT_S="${RESIDENT_TIMEOUT_S:-$PART_TIMEOUT_S}"
# limited LIMIT CMD...: CMD under `timeout LIMIT` when LIMIT is set
limited() { local s="$1"; shift; if [ -n "$s" ]; then timeout -k 5 "$s" "$@"; else "$@"; fi; }
EXTRA="${EXTRA:-}"
OUT="${OUT:-results/real_size}"
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
rc=0
# shellcheck disable=SC2206  # EXTRA: word-split on purpose
extra=($EXTRA)
common=(model="$MODEL" model.weights="$WEIGHTS" dataset=gsm8k workload.items="$ITEMS"
        workload.repeats=1 workload.max_new_tokens="$TOKENS" out_dir="$OUT/records"
        progress=false ${extra[@]+"${extra[@]}"})

if [ "$KERNEL_BENCH" = 1 ]; then
  echo "-- INT4 draft backends at DeepSeek's expert shape"
  "$PY" -m experiments.kernel_bench --out "$OUT/kernel" --device cuda --shapes deepseek \
    --tokens 1 --quick --write-choice || rc=1
fi
hw="$REAL_HW,$VIRTUAL_HW"
verdict=(--real-hardware "$REAL_HW" --virtual-hardware "$VIRTUAL_HW")
if [ "$VIRTUAL_HW" = none ]; then hw="$REAL_HW"; fi
echo "-- $SYSTEMS x hardware=$hw, budget.gb=$BUDGET_GB, model=$MODEL ($WEIGHTS weights)"
# budget outermost (Hydra sweeps the overrides' product in their order): every system at the
# first budget before any at the next, so a sweep cut by its time limit still compares them
limited "$SWEEP_TIMEOUT_S" "$PY" run.py -m "${common[@]}" budget=gb budget.gb="$BUDGET_GB" \
  system="$SYSTEMS" hardware="$hw" quant.method="$QUANT" || rc=1
if [ "$ADAPTIVE" = 1 ]; then
  echo "-- specter, K per window with the slots in view (spec.k=adaptive), budget.gb=${BUDGET_GB%%,*}"
  limited "$PART_TIMEOUT_S" "$PY" run.py "${common[@]}" budget=gb budget.gb="${BUDGET_GB%%,*}" \
    system=specter spec.k=adaptive hardware="$REAL_HW" quant.method="$QUANT" || rc=1
fi
if [ "$RESIDENT" = 1 ]; then
  echo "-- resident at budget=full, hardware=$REAL_HW,$VIRTUAL_HW"
  limited "$RESIDENT_TIMEOUT_S" "$PY" run.py -m "${common[@]}" system=resident budget=full \
    hardware="$hw" || rc=1
fi
if [ -n "$SOURCE_CHECK" ]; then
  echo "-- the source's own acceptance: model=$SOURCE_CHECK, specter, hardware=$REAL_HW"
  # eager draft step (spec.compile=off): the same proposals, without a compile warm-up
  limited "$PART_TIMEOUT_S" "$PY" run.py model="$SOURCE_CHECK" system=specter budget=high \
    hardware="$REAL_HW" spec.compile=off \
    dataset=gsm8k workload.items="$ITEMS" workload.repeats=1 workload.max_new_tokens="$TOKENS" \
    quant.method="$QUANT" out_dir="$OUT/source_records" progress=false || rc=1
  verdict+=(--source-records "$OUT/source_records")
fi
if [ -n "$HOTPATH" ]; then
  first="${BUDGET_GB%%,*}"
  echo "-- launches and syncs per committed token: $HOTPATH at budget.gb=$first"
  limited "$HOTPATH_TIMEOUT_S" "$PY" -m experiments.hotpath "$OUT/hotpath" system="$HOTPATH" model="$MODEL" \
    model.weights="$WEIGHTS" hardware="$REAL_HW" budget=gb budget.gb="$first" \
    quant.method="$QUANT" dataset=gsm8k workload.items=1 workload.max_new_tokens=17 \
    ${extra[@]+"${extra[@]}"} || rc=1
  verdict+=(--hotpath "$OUT/hotpath/hotpath.csv")
fi
if [ -z "$H2D_GBPS" ] && [ "$REAL_HW" = cuda ]; then
  H2D_GBPS=$("$PY" -c "from experiments.gpu_check import measure_h2d_gbps as m; g = m(); print(f'{g:.2f}' if g else '')" 2>/dev/null)
fi
[ -n "$H2D_GBPS" ] && verdict+=(--h2d-gbps "$H2D_GBPS")
echo "-- verdict"
"$PY" -m experiments.real_size "$OUT/records" --csv "$OUT/error_table.csv" "${verdict[@]}" || rc=1
exit $rc
