#!/usr/bin/env bash
# Run the same training command on every host of a Cloud TPU pod slice (TPU VMs).
# JAX's own runtime connects the hosts: on a TPU VM, jax.distributed.initialize() discovers the
# slice (sbd_jax.distributed); each host reads its own shard of the data and all hosts write
# one Orbax checkpoint. The code is copied from this checkout to every worker first.
#
#   TPU_NAME=my-v5p-128 ZONE=us-east5-a WORKDIR=gs://bucket/runs/llama8b_sbd \
#     launch/tpu_pod.sh configs/llama8b.py --config.train.init_from=gs://bucket/llama31_8b/params
#
# Check the fit first, from any machine: python -m sbd_jax.aot --config=CONFIG --topology=v5p-128
set -euo pipefail
CONFIG=${1:?usage: launch/tpu_pod.sh CONFIG [--config.overrides...]}
shift
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${WORKDIR:?set WORKDIR}"
REPO=${REPO:-sbd_jax}  # directory on the workers, relative to the home directory
# Collective / compute overlap for FSDP all-gathers (the usual flags for v4 / v5p / v6e).
LIBTPU_INIT_ARGS=${LIBTPU_INIT_ARGS:-"--xla_tpu_enable_async_collective_fusion=true \
--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true \
--xla_tpu_enable_async_collective_fusion_multiple_steps=true \
--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"}

# 1. The code, to every worker (git archive: tracked files only, no local venvs or runs).
git archive --format=tar.gz -o /tmp/sbd_jax_code.tgz HEAD
gcloud compute tpus tpu-vm scp /tmp/sbd_jax_code.tgz "$TPU_NAME":sbd_jax_code.tgz \
  --zone="$ZONE" --worker=all
# 2. Install and train on every worker; arguments are quoted for the remote shell.
printf -v ARGS ' %q' --config="$CONFIG" --workdir="$WORKDIR" "$@"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="
  set -e; mkdir -p ~/$REPO && tar -xzf ~/sbd_jax_code.tgz -C ~/$REPO && cd ~/$REPO &&
  pip install -q -e '.[tpu]' &&
  LIBTPU_INIT_ARGS='$LIBTPU_INIT_ARGS' python -m sbd_jax.train$ARGS"
