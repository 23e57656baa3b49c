"""Multi-host start-up: JAX's own runtime (`jax.distributed`), never a home-made orchestrator."""

from __future__ import annotations

import collections
import glob
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

# Set by the runtimes that launch one process per host (Cloud TPU multi-host and multislice,
# SLURM); jax.distributed.initialize() then finds the coordinator by itself.
_CLUSTER_ENV = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_JOB_ID")
_TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # a Cloud TPU VM's chips
# How long a process waits at `compiled_on_every_process` for the slowest to finish compiling.
COMPILE_BARRIER_TIMEOUT_S = 1800
_barriers: collections.Counter[str] = collections.Counter()  # uses of each barrier name


def on_cloud_tpu_vm() -> bool:
  """True on a Cloud TPU VM (its TPU chips are device files), whatever the environment says."""
  return any(glob.glob(pattern) for pattern in _TPU_DEVICE_FILES)


def initialize_mode() -> str:
  """How this process joins the job: "explicit" (JAX_COORDINATOR_ADDRESS and friends),
  "auto" (a cluster JAX discovers: TPU VM, multislice, SLURM) or "single" (one process)."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "explicit"
  if any(os.environ.get(name) for name in _CLUSTER_ENV) or on_cloud_tpu_vm():
    return "auto"
  return "single"


def maybe_initialize() -> None:
  """Call jax.distributed.initialize() when running multi-process.

  On Cloud TPU VMs (every host of a pod slice, with or without TPU_WORKER_HOSTNAMES set) and
  on SLURM clusters JAX discovers the coordinator itself; elsewhere set
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see launch/). A second call
  is a no-op.
  """
  if jax.distributed.is_initialized():
    return
  mode = initialize_mode()
  if mode == "explicit":
    if os.environ.get("SBD_CPU_COLLECTIVES"):  # multi-process on CPU (tests, laptops)
      jax.config.update("jax_cpu_collectives_implementation", os.environ["SBD_CPU_COLLECTIVES"])
    jax.distributed.initialize(
      os.environ["JAX_COORDINATOR_ADDRESS"],
      int(os.environ["JAX_NUM_PROCESSES"]),
      int(os.environ["JAX_PROCESS_ID"]),
    )
  elif mode == "auto":
    jax.distributed.initialize()


def is_lead_process() -> bool:
  """The process that prints results and writes shared files (process 0 of the job)."""
  return jax.process_index() == 0


def decided_by_lead(decide: Callable[[], np.ndarray], shape: Sequence[int]) -> np.ndarray:
  """`decide()` (a bool array of `shape`) run on the lead process only, its answer on every
  process: for choices that must agree across hosts, such as which work is left. A ValueError
  there is raised on every process (the others name the lead's log), so none waits forever."""
  if jax.process_count() == 1:
    return decide()
  answer, error = np.zeros(shape, np.int32), None
  if is_lead_process():
    try:
      answer = np.asarray(decide(), np.int32)
    except ValueError as e:
      error = e
  failed, answer = multihost_utils.broadcast_one_to_all((np.int32(error is not None), answer))
  if int(failed):
    raise error or ValueError("process 0 refused to start (its log says why)")
  return np.asarray(answer, bool)


def compiled_on_every_process(jitted, name: str, *args):
  """`jitted` (a jax.jit function) compiled for `args`, returned once every process has
  compiled it; run what it returns. Every process calls this for the same programs in the same
  order (`name` names the program).

  A program's first run connects the processes for its collectives (gloo on the CPU), and gloo
  waits only 30 s for the last one. Each process compiles for itself, some for longer: on a
  loaded machine, or when the persistent cache serves process 0 alone (on the CPU its key holds
  the process's own topology). This barrier, the coordination service's, involves no device and
  waits up to `COMPILE_BARRIER_TIMEOUT_S`; then all processes start the program together.
  """
  compiled = jitted.lower(*args).compile()
  if jax.process_count() > 1:
    _barriers[name] += 1
    ocp.multihost.get_barrier_sync_fn()(
      key=f"sbd_jax compiled {name} #{_barriers[name]}",
      timeout_ms=COMPILE_BARRIER_TIMEOUT_S * 1000,
    )
  return compiled
