"""XLA flags for the test processes and for the CLI subprocesses the tests start.

The suite checks what programs compute, not how fast they run, so it compiles with LLVM at -O0
(`--xla_backend_optimization_level=0`): XLA's HLO passes (fusion, layout, buffer assignment)
are those of a default build, and only the code generated for each fused kernel is left
unoptimised. That makes compiling, most of the suite's time, about a quarter cheaper. The
benchmarks, the README job and every number in BENCHMARKS.md run at XLA's default level.
"""

TEST_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_FLAGS}"
