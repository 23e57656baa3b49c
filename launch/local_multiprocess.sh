#!/usr/bin/env bash
# Two CPU processes with 4 simulated devices each form one 8-device mesh through
# jax.distributed (gloo collectives): the multi-host code path, on one machine.
#
#   launch/local_multiprocess.sh configs/tiny.py /tmp/sbd_mp --config.mesh.shape='(2,2,2)'
set -euo pipefail
CONFIG=${1:?usage: launch/local_multiprocess.sh CONFIG WORKDIR [--config.overrides...]}
WORKDIR=${2:?usage: launch/local_multiprocess.sh CONFIG WORKDIR [--config.overrides...]}
shift 2
PORT=${PORT:-12355}
export XLA_FLAGS=--xla_force_host_platform_device_count=4
export JAX_COORDINATOR_ADDRESS=127.0.0.1:$PORT JAX_NUM_PROCESSES=2 SBD_CPU_COLLECTIVES=gloo
pids=()
for i in 0 1; do
  JAX_PROCESS_ID=$i python -m sbd_jax.train --config="$CONFIG" --workdir="$WORKDIR" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
