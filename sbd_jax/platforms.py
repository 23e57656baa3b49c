"""JAX's platform on a machine with libtpu installed but no TPU (a CPU machine with the [tpu] or
[test] extra, for ahead-of-time TPU compiles): without JAX_PLATFORMS, JAX would probe for a TPU
at start-up and libtpu would print its errors before falling back to the CPU. Where that probe
cannot succeed, `quiet_cpu_default` sets JAX_PLATFORMS=cpu first; anything else is left alone.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on the PCI bus
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def has_tpu_chips() -> bool:
  for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(path) as f:
        if f.read().strip() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def quiet_cpu_default() -> None:
  """The CPU platform when JAX_PLATFORMS is unset, libtpu is installed, and the machine has
  neither TPU chips nor a CUDA plugin: the only case where JAX's TPU probe prints errors and
  then runs on the CPU anyway. Call it before JAX starts a backend (`cli.run` does)."""
  if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
    return
  if any(importlib.util.find_spec(p) is not None for p in CUDA_PLUGINS) or has_tpu_chips():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"  # for the processes this one starts
  if "jax" in sys.modules:  # imported, but no backend started yet: its flag still applies
    sys.modules["jax"].config.update("jax_platforms", "cpu")
