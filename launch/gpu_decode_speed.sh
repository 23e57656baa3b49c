#!/usr/bin/env bash
# Decode speed on one GPU (`benchmarks.decode_speed`): SBD against NTP for the 8B
# presets' shapes and the small models, bfloat16, random weights, each setting in a process of
# its own, in order of interest while a time budget lasts (a lease on a shared GPU is short).
#
#   pip install -e '.[gpu]'
#   launch/gpu_decode_speed.sh OUT [BUDGET_S=540]
#
# Each stage writes OUT/<stage>/{results.json,decode_speed.md,decode_speed.png} and
# OUT/<stage>.log; OUT/stages.log says which ran, which were skipped and how each ended. A stage
# starts only if its usual length is left, and is stopped at the budget's end: its log keeps the
# rows it finished (decode_speed logs each configuration as it completes).
set -uo pipefail
OUT=${1:?usage: launch/gpu_decode_speed.sh OUT [BUDGET_S]}
BUDGET_S=${2:-540}
PYTHON=${PYTHON:-python}
# The benchmarks live at the repository root, outside the installed package.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
NEW_TOKENS=${NEW_TOKENS:-128}  # per decode: at 32, a call's fixed cost weighs on r = 16
mkdir -p "$OUT"
deadline=$((SECONDS + BUDGET_S))

. "$(dirname "$0")/budget.sh"
# decode_speed NAME NEEDS_S FLAGS...: a stage of `benchmarks.decode_speed` (`budget.sh`).
# --concurrent_schedule: XLA's defaults (the benchmarks' own XLA options are for XLA:CPU).
decode_speed() {
  local name=$1 needs_s=$2
  shift 2
  stage "$name" "$needs_s" "$PYTHON" -m benchmarks.decode_speed --out="$OUT/$name" \
    --dtype=bfloat16 --concurrent_schedule --max_new_tokens="$NEW_TOKENS" --repeats=3 "$@"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  "$PYTHON" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# NEEDS_S: a stage's length on one H200 (llama8b 160-180 s; tiny 150 s for both prompt lengths).
# The memory-bound regime SBD is for: 16 GB of weights read per forward at batch 1.
decode_speed llama8b_b1_p16 180 --models=llama8b --batches=1 --prompt_lens=16
# A launch-bound model: what the loop costs per forward beyond the model's kernels.
decode_speed tiny_b1 150 --models=tiny --batches=1 --prompt_lens=16,256
decode_speed llama8b_b1_p256 180 --models=llama8b --batches=1 --prompt_lens=256
decode_speed m100_b1 150 --models=m100 --batches=1 --prompt_lens=16,256
# Where compute starts to count: 16 rows x 32 positions per wide forward.
decode_speed llama8b_b16_p16 180 --models=llama8b --batches=16 --prompt_lens=16
decode_speed qwen3_8b_b1_p16 180 --models=qwen3_8b --batches=1 --prompt_lens=16
cat "$OUT/stages.log"
