"""On a CPU machine with libtpu installed (the [test] extra), a CLI started without JAX_PLATFORMS
runs on the CPU without libtpu's start-up errors (`sbd_jax.platforms`, through `cli.run`)."""

import os
import subprocess
import sys

import pytest

from sbd_jax import platforms

PROGRAM = (
  "import jax\n"
  "from sbd_jax import cli\n"
  "cli.run(lambda argv: print(sorted({d.platform for d in jax.devices()})))\n"
)


@pytest.mark.integration  # a fresh process: JAX's platform is chosen once, at its start
def test_a_cli_without_jax_platforms_starts_on_the_cpu_quietly():
  if platforms.importlib.util.find_spec("libtpu") is None or platforms.has_tpu_chips():
    pytest.skip("needs libtpu installed on a machine without TPU chips")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run(
    [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().endswith("['cpu']")
  assert "tpu" not in out.stderr.lower(), out.stderr[-2000:]


def test_a_chosen_platform_is_left_alone(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  platforms.quiet_cpu_default()
  assert os.environ["JAX_PLATFORMS"] == "cuda"
