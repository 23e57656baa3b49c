"""JAX's persistent compilation cache for a run (`config.compile_cache`): a restarted job loads
its train step and decode programs from the cache instead of compiling them again.

The cache is keyed by the program, the devices and the compiler's version and flags, so one
directory serves every run of a config and every restart; on a pod, a `gs://` directory survives
the VMs. JAX writes entries from process 0 only and every process reads them.
"""

from __future__ import annotations

import jax
from jax.experimental.compilation_cache import compilation_cache

from sbd_jax import paths

WORKDIR = "workdir"  # the `compile_cache` value meaning <workdir>/compile_cache
SUBDIR = "compile_cache"


def directory(setting: str, workdir: str | None) -> str | None:
  """Where a run's cache lives: None (off) for "", <workdir>/compile_cache for "workdir",
  else `setting` itself (a local path or a URL)."""
  if not setting:
    return None
  if setting == WORKDIR:
    if workdir is None:
      raise ValueError(f'compile_cache="{WORKDIR}" needs a workdir; give the cache a path')
    return str(paths.resolve(workdir) / SUBDIR)
  return str(paths.resolve(setting))


def enable(path: str | None) -> None:
  """Points JAX's persistent compilation cache at `path` (None: leaves it as it is). Must run
  before the programs it should serve are compiled; a later call with another path moves the
  cache there."""
  if path is None or jax.config.jax_compilation_cache_dir == path:
    return
  paths.resolve(path).mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  compilation_cache.reset_cache()  # JAX decides once per process whether a cache is in use


def enable_for_run(c, workdir: str | None) -> None:
  """`enable` for the run config `c` (its `compile_cache` field) in `workdir`."""
  enable(directory(c.get("compile_cache", ""), workdir))
