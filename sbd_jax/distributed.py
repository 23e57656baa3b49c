"""Multi-host start-up: JAX's own runtime (`jax.distributed`), never a home-made orchestrator."""

from __future__ import annotations

import os

import jax


def maybe_initialize() -> None:
  """Call jax.distributed.initialize() when running multi-process.

  On TPU pods and SLURM/GKE clusters JAX discovers the coordinator itself; elsewhere set
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see launch/).
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    if os.environ.get("SBD_CPU_COLLECTIVES"):  # multi-process on CPU (tests, laptops)
      jax.config.update("jax_cpu_collectives_implementation", os.environ["SBD_CPU_COLLECTIVES"])
    jax.distributed.initialize(
      address, int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
    )
  elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("SLURM_JOB_ID"):
    jax.distributed.initialize()
