#!/usr/bin/env bash
# Submit a training run to a GKE TPU cluster with xpk (pip install xpk; the cluster exists).
# xpk builds an image from this directory on top of BASE_IMAGE, runs the command on every host
# of NUM_SLICES slices, and JAX discovers the slices (multislice: MEGASCALE_* env set by xpk).
#
#   CLUSTER=my-cluster TPU_TYPE=v5p-128 WORKDIR=gs://bucket/runs/llama8b_sbd \
#     launch/xpk.sh configs/llama8b.py --config.train.init_from=gs://bucket/llama31_8b/params
set -euo pipefail
CONFIG=${1:?usage: launch/xpk.sh CONFIG [--config.overrides...]}
shift
: "${CLUSTER:?set CLUSTER}" "${TPU_TYPE:?set TPU_TYPE (e.g. v5p-128)}" "${WORKDIR:?set WORKDIR}"
NUM_SLICES=${NUM_SLICES:-1}
WORKLOAD=${WORKLOAD:-sbd-$(date +%m%d-%H%M)}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS:-"--xla_tpu_enable_async_collective_fusion=true \
--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true \
--xla_tpu_enable_async_collective_fusion_multiple_steps=true \
--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"}
printf -v ARGS ' %q' --config="$CONFIG" --workdir="$WORKDIR" "$@"

xpk workload create \
  --cluster="$CLUSTER" --workload="$WORKLOAD" \
  --tpu-type="$TPU_TYPE" --num-slices="$NUM_SLICES" \
  --base-docker-image="$BASE_IMAGE" --script-dir="$(git rev-parse --show-toplevel)" \
  --command="pip install -q -e '.[tpu]' && LIBTPU_INIT_ARGS='$LIBTPU_INIT_ARGS' python -m sbd_jax.train$ARGS"
