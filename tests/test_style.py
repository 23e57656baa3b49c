"""The tree is formatted (ruff format) and lint-clean (ruff check), with ruff.toml's settings."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["sbd_jax", "tests", "configs", "setup.py"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
  ruff = shutil.which("ruff")
  if ruff is None:
    pytest.fail("ruff is not installed; pip install -e '.[test]'")
  return subprocess.run([ruff, *args, *PATHS], cwd=ROOT, capture_output=True, text=True)


def test_code_is_formatted():
  proc = _ruff("format", "--check")
  assert proc.returncode == 0, "run `ruff format`:\n" + proc.stdout + proc.stderr


def test_code_is_lint_clean():
  proc = _ruff("check")
  assert proc.returncode == 0, "run `ruff check`:\n" + proc.stdout + proc.stderr
