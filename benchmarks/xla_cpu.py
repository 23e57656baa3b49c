"""How the CPU benchmarks compile and where they run: XLA:CPU's sequential schedule and
copy insertion with region analysis (`use_xla_cpu_options`), and a process pinned to some of
its cores (`use_cpus`). Both must take effect before JAX starts its CPU backend; neither changes
a computed value (tests/test_decode_speed.py decodes the same tokens under both). Library code
leaves XLA_FLAGS to the user: only the benchmarks set these.
"""

from __future__ import annotations

import os

from absl import flags

# The schedule without its reordering for concurrent ops, and copy insertion with region
# analysis.
SEQUENTIAL_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
REGION_COPY_INSERTION = "--xla_cpu_copy_insertion_use_region_analysis=true"
XLA_CPU_OPTIONS = (SEQUENTIAL_SCHEDULE, REGION_COPY_INSERTION)


def use_cpus(count: int) -> list[int]:
  """Restrict this process to its first `count` CPU cores (0: leave it as it is); returns the
  cores it runs on. Must run before JAX starts its CPU backend, which sizes its thread pool to
  the cores the process may use. XLA runs a small model's forward as a chain of tiny ops that
  its threads take turns at, so on a few cores every step can cross cores; on one core such
  a model's timings are steadier, while a larger model's matmuls use every core."""
  cores = sorted(os.sched_getaffinity(0))
  if not count:
    return cores
  if not 0 < count <= len(cores):
    raise ValueError(f"--cpus={count}: this process may use {len(cores)} cores")
  _before_backend("--cpus")
  os.sched_setaffinity(0, cores[:count])
  return cores[:count]


def use_xla_cpu_options(defaults: bool) -> str:
  """Compile every program with `XLA_CPU_OPTIONS`, or with XLA:CPU's defaults (`defaults`,
  `--concurrent_schedule`); returns the XLA_FLAGS in force. Must run before JAX starts its CPU
  backend.

  - The sequential schedule. By default XLA:CPU orders a program's ops so that its executor can
    run independent ones on several threads at once. A small model's forward is a chain of small
    ops: on a few cores that buys little and costs hand-offs between threads, more in some
    programs than in others, which makes ratios of two programs' times noisy.
  - Copy insertion with region analysis proves more buffers inside while loops safe to update in
    place: fewer copies at the top of each decode forward, and no hand-off of each forward to a
    second thread (BENCHMARKS.md, decode speed)."""
  if defaults:
    return os.environ.get("XLA_FLAGS", "")
  _before_backend("XLA:CPU's sequential schedule and region analysis")
  flags_now = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join([flags_now, *XLA_CPU_OPTIONS]).strip()
  return os.environ["XLA_FLAGS"]


def _before_backend(flag: str) -> None:
  from jax._src import xla_bridge  # the only way to ask whether a backend exists yet

  if xla_bridge.backends_are_initialized():
    raise ValueError(f"{flag} must take effect before JAX starts its CPU backend")


def define_schedule_flag() -> None:
  """--concurrent_schedule, for each CPU benchmark that compiles through `use_xla_cpu_options`."""
  flags.DEFINE_bool(
    "concurrent_schedule",
    False,
    "Compile with XLA:CPU's defaults (its concurrent schedule, copy insertion without region "
    "analysis); see `xla_cpu.use_xla_cpu_options`.",
  )
