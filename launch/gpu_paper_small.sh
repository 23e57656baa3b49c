#!/usr/bin/env bash
# The paper's recipe at small scale (configs/paper_small.py) on one GPU: train, then decode the
# 512 held-out problems with NTP and with SBD (blocks of 16, γ 0.1 and 0.35), then the
# diagnostics that say where SBD loses to NTP (MATP loss by block offset and by k, what a
# whole-masked block misses).
#
#   pip install -e '.[gpu]'
#   launch/gpu_paper_small.sh WORKDIR [--config.train.steps=N ...]
#
# The workdir resumes: rerun the same command after an interruption. WORKDIR/train.log,
# WORKDIR/diagnostics.json.
set -euo pipefail
WORKDIR=${1:?usage: launch/gpu_paper_small.sh WORKDIR [CONFIG_OVERRIDES...]}
shift
PYTHON=${PYTHON:-python}
mkdir -p "$WORKDIR"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
PYTHONUNBUFFERED=1 "$PYTHON" -m sbd_jax.train --config=configs/paper_small.py \
  --workdir="$WORKDIR" --config.train.progress_bar=false "$@" 2>&1 | tee -a "$WORKDIR/train.log"
"$PYTHON" -m sbd_jax.evaluate --workdir="$WORKDIR" --diagnostics --json > "$WORKDIR/diagnostics.json"
"$PYTHON" -m sbd_jax.evaluate --workdir="$WORKDIR" --diagnostics
