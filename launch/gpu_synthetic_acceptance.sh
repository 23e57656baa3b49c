#!/usr/bin/env bash
# Verified SBD against NTP on one GPU at acceptance fixed by construction
# (`benchmarks.synthetic_acceptance`): Llama-3.1 8B's shapes, random bfloat16 weights, no
# drafts accepted and 4 accepted per check, at batch 1, 16 and 64, each batch in a process of
# its own while a time budget lasts (a lease on a shared GPU is short).
#
#   pip install -e '.[gpu]'
#   launch/gpu_synthetic_acceptance.sh OUT [BUDGET_S=540]
#
# Each stage writes OUT/<stage>/{results.json,synthetic_acceptance.md,.png} and OUT/<stage>.log
# (a line per k as it completes); OUT/stages.log says which ran and how each ended.
set -uo pipefail
OUT=${1:?usage: launch/gpu_synthetic_acceptance.sh OUT [BUDGET_S]}
BUDGET_S=${2:-540}
PYTHON=${PYTHON:-python}
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
# Each k drops the compiled programs (its drafts are bound at tracing); NTP's program is the
# same for every k, and JAX's persistent cache loads it back instead of compiling it again.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$OUT/compile_cache}
deadline=$((SECONDS + BUDGET_S))

. "$(dirname "$0")/budget.sh"
# accepted NAME NEEDS_S FLAGS...: a stage of `benchmarks.synthetic_acceptance` (`budget.sh`).
# NEEDS_S is an estimate (each k compiles the verified program, about a minute for the 8B
# shape, and loads NTP's from the cache), not yet measured on a GPU.
accepted() {
  local name=$1 needs_s=$2
  shift 2
  stage "$name" "$needs_s" "$PYTHON" -m benchmarks.synthetic_acceptance --out="$OUT/$name" \
    --models=llama8b --dtype=bfloat16 --max_new_tokens=128 --repeats=3 --accepted=0,4 "$@"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PYTHON" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

accepted llama8b_b1 240 --batches=1
accepted llama8b_b16 240 --batches=16
accepted llama8b_b64 240 --batches=64
cat "$OUT/stages.log"
