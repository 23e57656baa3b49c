"""TPU slices this machine may not have: chip specs, slice names and their devices.

With `libtpu` installed (`pip install -e ".[tpu]"`), JAX on a CPU-only machine can describe a
TPU slice and compile for it. `--topology` takes a slice name (`v5p-16`: 16 TensorCores = 8
chips; `v5e-16` / `v6e-16`: 16 chips; `v4-16`: 16 TensorCores) or a chip grid as JAX names it
(`v5p:2x2x4`, `v6e:4x4`); several slices form a multislice job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os

from sbd_jax import config as config_lib


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_bytes: int  # per chip
  peak_flops: float  # dense bf16 FLOP/s per chip
  cores_in_slice_name: bool  # v4-N / v5p-N count TensorCores (2 per chip), v5e-N / v6e-N chips
  grid_dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)


PROGRAMS = {"train": "train step", "decode": "decode loop"}

# Public spec sheets.
CHIPS = {
  "v4": Chip(32 * 2**30, 275e12, True, 3),
  "v5p": Chip(95 * 2**30, 459e12, True, 3),
  "v5e": Chip(16 * 2**30, 197e12, False, 2),
  "v6e": Chip(32 * 2**30, 918e12, False, 2),
}


def chip_grid(chips: int, dims: int) -> str:
  """The most cubic (dims=3) or square (dims=2) power-of-two grid of `chips` chips."""
  if chips < 1 or chips & (chips - 1):
    raise config_lib.ConfigError(f"a slice of {chips} chips is not a power of two")
  if dims == 3 and chips < 8:  # one host's 2x2x1 block, or part of it
    return {1: "1x1x1", 2: "1x2x1", 4: "2x2x1"}[chips]
  exponent, grid = int(math.log2(chips)), [1] * dims
  for i in range(exponent):  # grow the sides in turn: 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
    grid[dims - 1 - i % dims] *= 2
  return "x".join(map(str, sorted(grid)))


def parse_topology(name: str) -> tuple[str, str]:
  """'v5p-16' or 'v5p:2x2x4' -> (chip generation, JAX topology name)."""
  generation, sep, rest = name.partition(":" if ":" in name else "-")
  if generation == "v5litepod":
    generation = "v5e"
  if generation not in CHIPS or not sep or not rest:
    raise config_lib.ConfigError(
      f"unknown topology {name!r}; use e.g. v5p-16, v5e-8, v6e-16, v4-8 or v5p:2x2x4"
    )
  if sep == ":":
    return generation, name
  if not rest.isdigit():
    raise config_lib.ConfigError(f"topology {name!r}: expected a number after '-'")
  chip = CHIPS[generation]
  chips = int(rest) // 2 if chip.cores_in_slice_name else int(rest)
  return generation, f"{generation}:{chip_grid(max(chips, 1), chip.grid_dims)}"


# What libtpu reads when it loads. Off a TPU VM it would ask the GCE metadata server for the
# slice's worker hostnames and print an INVALID_ARGUMENT error to stderr when the answer is
# not a hostname; describing a slice needs none of it.
_NO_TPU_ENV = {
  "TPU_ACCELERATOR_TYPE": "v5p-16",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_SKIP_MDS_QUERY": "1",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # no lock: nothing runs on a chip
}


@contextlib.contextmanager
def _libtpu_without_a_tpu():
  """Load libtpu quietly on a machine without TPU chips; the environment is restored after, so
  that nothing later reads these values as a cluster's (see `distributed`)."""
  from sbd_jax import distributed

  if distributed.on_cloud_tpu_vm():
    yield
    return
  added = {k: v for k, v in _NO_TPU_ENV.items() if k not in os.environ}
  os.environ.update(added)
  try:
    yield
  finally:
    for k in added:
      os.environ.pop(k, None)


def topology_devices(topology_name: str, num_slices: int = 1) -> list:
  """The devices of `num_slices` slices of `topology_name` (several: a multislice job, whose
  devices carry their `slice_index`)."""
  from jax.experimental import topologies

  if num_slices < 1:
    raise config_lib.ConfigError(f"num_slices must be >= 1, got {num_slices}")
  try:
    with _libtpu_without_a_tpu():
      return list(
        topologies.get_topology_desc(
          platform="tpu", topology_name=topology_name, num_slices=num_slices
        ).devices
      )
  except Exception as e:  # missing libtpu, or a grid libtpu does not know
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = (
      "" if importlib.util.find_spec("libtpu") else '; libtpu is missing: pip install -e ".[tpu]"'
    )
    raise config_lib.ConfigError(
      f"cannot describe TPU topology {topology_name!r}: {first_line}{hint}"
    ) from None
