#!/usr/bin/env bash
# Every experiment of the paper, then every figure and table from the parquet they wrote.
#
#   scripts/reproduce_all.sh --quick     small project-made models, short workload, virtual clock
#                                        of a modelled A100 + PCIe 4.0 (2 CPU cores: about 2 h
#                                        on a warm model cache, plus 11-22 min per small model's
#                                        first build; see ARTIFACT.md, "Time")
#   scripts/reproduce_all.sh --small     the same models with the artifact's full workload
#                                        (5 items x 128 tokens per dataset; hours on a CPU)
#   scripts/reproduce_all.sh --full      real DeepSeek-V2-Lite, Qwen1.5-MoE, Phi-3.5-MoE on the GPU
#                                        (real time); set DEEPSEEK_PATH, QWEN_PATH, PHI_PATH to
#                                        local safetensors checkpoints
# Options: --out DIR (results root; default results/<profile>), --figures DIR (default
# figures/<profile>), --only STEP[,STEP...] (main, cache, ablation, latency, oracle, depth,
# working_set, batch, hybrid, crossover, fidelity, routing, memory, kernel, anchors, validate, figures), then `--` and extra run.py overrides.
# On the virtual clock (--quick, --small) the timed steps run on BOTH engine profiles of the
# modelled A100, a100_pcie4_ideal (optimised engine) and a100_pcie4_hf (eager framework;
# docs/calibration.md), and the figures show them side by side.
# Resumable: every step skips the rows already recorded, so rerun the same command after a
# crash or an interruption. Progress: one header per step with the elapsed time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

PROFILE="" OUT="" FIGS="" ONLY="" EXTRA=()
STEPS="main cache ablation latency oracle depth working_set batch hybrid crossover fidelity routing memory kernel anchors validate figures"
need_value() {  # an option that takes a value got none
  [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || {
    echo "reproduce_all.sh: $1 needs a value (see the header of this script)." >&2; exit 2; }
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick|--small|--full)
      if [[ -n "$PROFILE" && "$PROFILE" != "${1#--}" ]]; then
        echo "reproduce_all.sh: choose one profile, not both --$PROFILE and $1." >&2; exit 2
      fi
      PROFILE="${1#--}"; shift ;;
    --out) need_value "$@"; OUT="$2"; shift 2 ;;
    --figures) need_value "$@"; FIGS="$2"; shift 2 ;;
    --only)
      need_value "$@"
      for s in ${2//,/ }; do
        [[ " $STEPS " == *" $s "* ]] || {
          echo "reproduce_all.sh: unknown step '$s' for --only; choose from: ${STEPS// /, }." >&2; exit 2; }
      done
      ONLY=",$2,"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "reproduce_all.sh: unknown argument '$1'; use --quick, --small or --full (see the header of this script)." >&2; exit 2 ;;
  esac
done
if [[ -z "$PROFILE" ]]; then
  echo "reproduce_all.sh: choose a profile: --quick (CPU, about 2 h warm), --small (CPU, hours) or --full (GPU, real models)." >&2
  exit 2
fi
OUT="${OUT:-results/$PROFILE}"
FIGS="${FIGS:-figures/$PROFILE}"
[[ -x "$PY" ]] || { echo "reproduce_all.sh: $PY not found; run 'make setup' first." >&2; exit 2; }

case "$PROFILE" in
  quick)
    MOE=(small_deepseek small_qwen small_phi); DS=small_deepseek
    HW=(hardware=a100_pcie4_ideal,a100_pcie4_hf); HW1=(hardware=a100_pcie4_hf)
    WL=(workload.items=1 workload.max_new_tokens=32 workload.repeats=1)
    # the main case: several windows per request (3 items x 128 tokens, gsm8k and wikitext2).
    # Its Specter / SpecMoEOff leads against --small's (docs/measurements/small-ratio-2026-12-04.md):
    # small_deepseek +2 to +6%, small_qwen -7 to 0%, small_phi -13% (its two smallest-lead
    # datasets; within 2% on the same two). 64 tokens over gsm8k and humaneval gave 12-21% below
    # (quick-2026-12-02.md)
    MAIN_WL=(workload.items=3 workload.max_new_tokens=128 workload.repeats=1)
    # spec.k=auto (the main step): the depth profiler on 2 prompts, one run (the clock is exact)
    PROFILER=(spec.profile_prompts=2 spec.profile_runs=1 "spec.profile_ks=[4,8,16,32]")
    VALIDATE=(--items 1 --tokens 32 --datasets gsm8k)
    ANCHORS=(--items 2 --tokens 32 --datasets gsm8k)
    MAIN_DATASETS=gsm8k,wikitext2
    DEPTH_KS=2,4,8,16,32
    WS_KS=1,2,4,8,16,32
    FIDELITY=("quant.method=rtn quant.bits=2,3,4,8" "quant.method=gptq quant.bits=4")
    ROUTING=(--models small_deepseek,small_qwen,small_phi)
    # batch: the 32 mix prompts at B = 1, 8, 32, 32 new tokens, the eager profile only
    BATCH=(hardware=a100_pcie4_hf workload.batch=1,8,32 workload.max_new_tokens=32)
    KERNEL=(--quick) ;;
  small)
    MOE=(small_deepseek small_qwen small_phi); DS=small_deepseek
    HW=(hardware=a100_pcie4_ideal,a100_pcie4_hf); HW1=(hardware=a100_pcie4_hf)
    WL=(workload.repeats=1)  # the artifact's 5 items x 128 tokens; the virtual clock needs 1 repeat
    MAIN_WL=("${WL[@]}")
    PROFILER=(spec.profile_runs=1)
    VALIDATE=(--items 5 --tokens 128 --datasets gsm8k,wikitext2,humaneval,gpqa,c4)
    ANCHORS=(--items 5 --tokens 64 --datasets gsm8k,wikitext2)
    MAIN_DATASETS=gsm8k,wikitext2,humaneval,gpqa,c4
    DEPTH_KS=2,4,6,8,12,16,20,24,32
    WS_KS=1,2,4,8,16,32
    FIDELITY=("quant.method=gptq,rtn quant.bits=2,3,4,8")
    ROUTING=(--models small_deepseek,small_qwen,small_phi)
    BATCH=("${HW[@]}")  # B = 1, 4, 8, 16, 32 x 128 tokens (conf/experiment/batch.yaml)
    KERNEL=() ;;
  full)
    for v in DEEPSEEK_PATH QWEN_PATH PHI_PATH; do
      [[ -n "${!v:-}" ]] || { echo "reproduce_all.sh --full: set $v to a local checkpoint folder (see conf/model/*.yaml for the hub ids)." >&2; exit 2; }
    done
    MOE=("deepseek model.path=$DEEPSEEK_PATH" "qwen model.path=$QWEN_PATH" "phi model.path=$PHI_PATH")
    DS="deepseek model.path=$DEEPSEEK_PATH"
    HW=(hardware=cuda); HW1=(hardware=cuda)
    WL=()  # the artifact's workload: 5 items x 128 tokens x 3 repeats
    MAIN_WL=()
    PROFILER=()
    VALIDATE=()  # the validation table compares virtual-clock profiles: not a --full step
    ANCHORS=()  # so do the independent anchors
    MAIN_DATASETS=gsm8k,wikitext2,humaneval,gpqa,c4
    DEPTH_KS=2,4,6,8,12,16,20,24,32
    WS_KS=1,2,4,8,16,32
    FIDELITY=("quant.method=gptq,rtn quant.bits=2,3,4,8")
    ROUTING=(--models deepseek,qwen,phi --device cuda --path "deepseek=$DEEPSEEK_PATH"
             --path "qwen=$QWEN_PATH" --path "phi=$PHI_PATH")
    BATCH=(hardware=cuda "model=deepseek" "model.path=$DEEPSEEK_PATH")
    KERNEL=(--device cuda) ;;
esac

T0=$SECONDS STEP=0
want() { [[ -z "$ONLY" || "$ONLY" == *",$1,"* ]]; }
header() {
  STEP=$((STEP + 1))
  printf '\n=== [%d] %s  (profile %s, %dm%02ds elapsed) ===\n' "$STEP" "$1" "$PROFILE" \
    $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60))
}
run() {  # run.py multirun with the profile's common settings; $1 = experiment name
  local exp="$1"; shift
  "$PY" run.py -m experiment="$exp" out_dir="$OUT/$exp" progress=false "${HW[@]}" "${WL[@]}" \
    "$@" "${EXTRA[@]}"
}

if want main; then
  WL_ALL=("${WL[@]}"); WL=("${MAIN_WL[@]}")
  for m in "${MOE[@]}"; do
    header "main: TPOT of every system x budget x dataset, model=${m%% *}"
    # shellcheck disable=SC2086
    run main model=$m dataset="$MAIN_DATASETS" "${PROFILER[@]}"
    # SpecMoEOff at the profiled K instead of its own K = 3: its own bar in the figure
    # shellcheck disable=SC2086
    run main model=$m dataset="$MAIN_DATASETS" "${PROFILER[@]}" system=specmoeoff \
      spec.tune_own_k=true budget=high
  done
  WL=("${WL_ALL[@]}")
fi
# shellcheck disable=SC2086  # $DS and $m may carry "model.path=..." as a second word
if want cache; then
  header "cache: hit rate x budget"
  HW_ALL=("${HW[@]}"); HW=("${HW1[@]}"); run cache model=$DS; HW=("${HW_ALL[@]}")
fi
if want ablation; then header "ablation: the paper's four rows (full, no PIO, no PIO+SIC, none)"; run ablation model=$DS; fi
if want latency; then header "latency: H2D total, exposed and hidden"; run latency model=$DS; fi
if want oracle; then header "oracle: wrong prefetch IDs 0-75%"; run oracle model=$DS; fi
if want depth; then  # the main case's workload: K* here is the K the main step profiles
  WL_ALL=("${WL[@]}"); WL=("${MAIN_WL[@]}")
  for m in "${MOE[@]}"; do
    header "depth: TPOT vs K, model=${m%% *}"
    run depth model=$m spec.k="$DEPTH_KS" budget=high dataset="$MAIN_DATASETS"
  done
  WL=("${WL_ALL[@]}")
fi
if want working_set; then
  header "working_set: distinct experts vs K; speculative speedup, MoE vs dense twin"
  # The dense twin exists only project-made, so this comparison always runs the small
  # DeepSeek-shaped MoE and its twin on the virtual clock (real DeepSeek-V2-Lite sizes charged);
  # the depth step records the real models' working sets (distinct_experts_per_forward) too.
  HW_PROFILE=("${HW[@]}"); HW=(hardware=a100_pcie4_hf)
  run working_set model=small_deepseek,small_dense spec.k="$WS_KS"
  HW=("${HW_PROFILE[@]}")
fi
if want batch; then
  header "batch: TPOT and throughput vs batch size (B = 32 beside the paper's)"
  # Its own workload (32 interleaved prompts; the profile's workload.items would cut them).
  "$PY" run.py -m experiment=batch out_dir="$OUT/batch" progress=false "${BATCH[@]}" "${EXTRA[@]}"
fi
if want hybrid; then  # host-computed misses
  header "hybrid: host-computed misses (specter_hybrid, lru_hybrid) beside specter, lru, specmoeoff"
  HW_ALL=("${HW[@]}"); [[ "$PROFILE" == quick ]] && HW=("${HW1[@]}")
  if [[ "$PROFILE" == full ]]; then
    # real CUDA time; the host's and the link's rates decide: the host beside this GPU measured
    # now (conf/host/measured.yaml), the GPU's profile from scripts/calibrate_gpu.py
    "$PY" -m experiments.host_rate --write
    HW=("hardware=${HYBRID_PROFILE:-h200_measured}" hardware.clock=wall host=measured)
    for m in "${MOE[@]}"; do
      # shellcheck disable=SC2086
      run hybrid model=$m
    done
  else
    run hybrid
  fi
  HW=("${HW_ALL[@]}")
fi
if want fidelity; then
  for m in "${MOE[@]}"; do
    for q in "${FIDELITY[@]}"; do
      header "fidelity: draft vs target routing, model=${m%% *}, $q"
      # shellcheck disable=SC2086
      HW_ALL=("${HW[@]}"); HW=("${HW1[@]}")  # routing only: no clock involved
      run fidelity model=$m dataset=gsm8k $q
      HW=("${HW_ALL[@]}")
    done
  done
fi
if want routing; then
  header "routing: working-set curve, reuse, load entropy, distinct-4, draft fidelity and acceptance vs the real models"
  "$PY" -m experiments.routing_report "${ROUTING[@]}" --out "$OUT/routing"
fi
if want memory; then
  header "memory: the shared instance vs two models"
  "$PY" -m experiments.memory_table --out "$OUT/memory"
fi
if want kernel; then
  header "kernel: INT4 draft kernel and verification reordering microbenchmark"
  "$PY" -m experiments.kernel_bench --out "$OUT/kernel" "${KERNEL[@]}"
fi
if want crossover && [[ "$PROFILE" != full ]]; then  # a virtual-clock sweep of the host's rates
  header "crossover: specter, specter_hybrid and host_experts against the host's memory bandwidth"
  # its own profile and workload (conf/experiment/crossover.yaml); specter and resident do not
  # use the host: one run each
  "$PY" run.py -m experiment=crossover out_dir="$OUT/crossover" progress=false "${EXTRA[@]}"
  "$PY" run.py -m experiment=crossover out_dir="$OUT/crossover" progress=false \
    system=specter,resident hardware.host_mem_bandwidth_Bps=3.0e11 "${EXTRA[@]}"
fi
if want anchors && [[ ${#ANCHORS[@]} -gt 0 ]]; then
  # into the validation tree: the validate step appends these rows to its table
  header "anchors: publications other than the Specter paper, in their own settings"
  "$PY" -m experiments.anchors "$OUT/validate" "${ANCHORS[@]}"
fi
if want validate && [[ ${#VALIDATE[@]} -gt 0 ]]; then
  header "validate: every paper number beside ours, per engine profile"
  "$PY" -m experiments.validate "$OUT/validate" "${VALIDATE[@]}"
fi
if want figures; then
  header "figures and tables from parquet -> $FIGS"
  "$PY" -m experiments.plots "$OUT" --out "$FIGS"
  if [[ -f "$OUT/validate/validation.md" ]]; then cp "$OUT/validate/validation.md" "$FIGS/"; fi
fi
printf '\nreproduce_all.sh: done in %dm%02ds; results under %s, figures and tables under %s\n' \
  $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60)) "$OUT" "$FIGS"
