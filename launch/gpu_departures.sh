#!/usr/bin/env bash
# Which of the README job's departures from the paper matter (benchmarks/departures.py) on one
# GPU: the seven seed-0 runs at once as parallel processes, then the two extra seeds of the two
# costliest reversions. 8 min 10 s on one H200 beside two JSONL tasks.
#
#   pip install -e '.[gpu]'
#   launch/gpu_departures.sh OUT [--extra_seeds=2 ...]
#
# Later flags win. Finished runs are kept and unfinished ones resume: rerun the same command
# after an interruption. Outputs: OUT/results.json, OUT/departures.md, OUT/departures.png.
set -euo pipefail
OUT=${1:?usage: launch/gpu_departures.sh OUT [FLAGS...]}
shift
PYTHON=${PYTHON:-python}
# The benchmarks live at the repository root, outside the installed package.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
PYTHONUNBUFFERED=1 "$PYTHON" -m benchmarks.departures --out="$OUT" --jobs=7 "$@"
