#!/usr/bin/env bash
# The paper's recipe (configs/paper_small.py) on the JSONL tasks copy, shift and reverse, on one
# GPU: 64 rows per step, 8,000 steps, 200,000 training records per task, the three tasks as
# parallel processes (a small model leaves the GPU mostly idle). Then each task's held-out
# records decoded with NTP and SBD, and its diagnostics. One task alone took 2 min 41 s on one
# H200.
#
#   pip install -e '.[gpu]'
#   launch/gpu_jsonl_tasks.sh OUT [--tasks=copy,shift ...]
#
# Later flags win. A finished task is kept: rerun the same command after an interruption.
# Outputs: OUT/results.json, OUT/jsonl_tasks.md, OUT/jsonl_tasks.png, OUT/<task>/diagnostics.txt.
set -euo pipefail
OUT=${1:?usage: launch/gpu_jsonl_tasks.sh OUT [FLAGS...]}
shift
PYTHON=${PYTHON:-python}
# The benchmarks live at the repository root, outside the installed package.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
PYTHONUNBUFFERED=1 "$PYTHON" -m benchmarks.jsonl_tasks --out="$OUT" \
  --tasks=copy,shift,reverse --steps=8000 --batch_size=64 --num_train=200000 --num_workers=3 \
  --jobs=3 "$@"
