#!/usr/bin/env bash
# The paper's recipe at small scale (configs/paper_small.py) on one GPU, with 16x the CPU run's
# training tokens: 64 rows per step (not 8) and 12,000 steps (not 6,000), the first 30 % NTP
# alone. Then the 512 held-out problems decoded with NTP and with SBD (blocks of 16) over a γ
# sweep, and the diagnostics that say where SBD loses to NTP (MATP loss by block offset and by
# k, what a whole-masked block misses). About 3 min on one H200.
#
#   pip install -e '.[gpu]'
#   launch/gpu_paper_small.sh WORKDIR [--config.train.steps=N ...]
#
# Later overrides win. The workdir resumes: rerun the same command after an interruption (with
# the same data.num_workers: the data iterator's saved state is per worker). Outputs:
# WORKDIR/train.log (ends with the held-out table), WORKDIR/gamma_sweep.json,
# WORKDIR/diagnostics.txt.
set -euo pipefail
WORKDIR=${1:?usage: launch/gpu_paper_small.sh WORKDIR [CONFIG_OVERRIDES...]}
shift
PYTHON=${PYTHON:-python}
mkdir -p "$WORKDIR"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
PYTHONUNBUFFERED=1 "$PYTHON" -m sbd_jax.train --config=configs/paper_small.py \
  --workdir="$WORKDIR" --config.train.progress_bar=false --config.train.batch_size=64 \
  --config.train.steps=12000 --config.data.num_workers=6 "$@" 2>&1 | tee -a "$WORKDIR/train.log"
"$PYTHON" -m sbd_jax.evaluate --workdir="$WORKDIR" --gammas=0.001,0.003,0.01,0.1,0.35 --json \
  > "$WORKDIR/gamma_sweep.json"
"$PYTHON" -m sbd_jax.evaluate --workdir="$WORKDIR" --diagnostics | tee "$WORKDIR/diagnostics.txt"
