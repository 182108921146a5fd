#!/usr/bin/env bash
# The compiled draft step's benchmark (not a timed test; issue 36 item 4), on THIS CPU's own
# clock (hardware=cpu: the CPU is the device, every expert resident, budget=full):
# small_deepseek, 3 gsm8k items x 64 tokens, 2 repeats; resident eager (system.compile=off) and
# with the default (auto: on this clock its decode step one graph, the fair baseline); Specter
# eager on cpu_int4 (the CPU's eager default), eager on gather_int4, and with the defaults
# (quant.backend=auto and spec.compile=auto: gather_int4, the step compiled by inductor). The
# table (experiments/compile_table.py) gives each case's TPOT, the draft step's time, and the
# compile time (the runner's untimed warm-up request). Resumable.
# Usage: scripts/bench_compile.sh [OUT_DIR] [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${1:-results/bench_compile}"
MODEL="${2:-small_deepseek}"
COMMON=(model="$MODEL" dataset=gsm8k hardware=cpu budget=full out_dir="$OUT" progress=false
        workload.items=3 workload.repeats=2 workload.max_new_tokens=64 spec.k=4)
"$PY" run.py -m "${COMMON[@]}" system=resident system.compile=off,auto
"$PY" run.py -m "${COMMON[@]}" system=specter quant.backend=cpu_int4,gather_int4 spec.compile=off
"$PY" run.py -m "${COMMON[@]}" system=specter
"$PY" -m experiments.compile_table "$OUT"
