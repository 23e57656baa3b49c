"""XLA flags for the test processes and for the CLI subprocesses the tests start.

The suite checks what programs compute, not how fast they run, so it compiles with LLVM at -O0
(`--xla_backend_optimization_level=0`): most of its time is compilation. XLA's HLO passes
(fusion, layout, buffer assignment) still run as in a default build; only the machine code of
each kernel is left unoptimised, and the README model's SBD train step compiles to the same
optimised HLO and the same memory analysis at both levels. The benchmarks, the README job and
every number in BENCHMARKS.md run at XLA's default level.
"""

import os

TEST_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_FLAGS}"


def subprocess_env(devices: int, **extra: str) -> dict[str, str]:
  """This process's environment for a subprocess with `devices` CPU devices, plus `extra`."""
  return dict(os.environ, XLA_FLAGS=xla_flags(devices), **extra)
