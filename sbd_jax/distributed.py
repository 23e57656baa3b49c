"""Multi-host start-up: JAX's own runtime (`jax.distributed`), never a home-made orchestrator."""

from __future__ import annotations

import glob
import os

import jax

# Set by the runtimes that launch one process per host (Cloud TPU multi-host and multislice,
# SLURM); jax.distributed.initialize() then finds the coordinator by itself.
_CLUSTER_ENV = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_JOB_ID")
_TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # a Cloud TPU VM's chips


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
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see launch/).
  """
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
