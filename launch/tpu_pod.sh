#!/usr/bin/env bash
# Run the same training command on every host of a Cloud TPU pod slice.
# JAX's own runtime connects the hosts (jax.distributed.initialize() discovers the slice);
# each host reads its own shard of the data and all hosts write one Orbax checkpoint.
#
#   TPU_NAME=my-v5p-128 ZONE=us-east5-a WORKDIR=gs://bucket/runs/llama8b_sbd \
#     launch/tpu_pod.sh configs/llama8b.py --config.train.init_from=gs://bucket/llama31_8b/params
set -euo pipefail
CONFIG=${1:?usage: launch/tpu_pod.sh CONFIG [--config.overrides...]}
shift
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${WORKDIR:?set WORKDIR}"
REPO=${REPO:-~/sbd_jax}

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  cd $REPO && pip install -q -e '.[tpu]' &&
  python -m sbd_jax.train --config=$CONFIG --workdir=$WORKDIR $*"
