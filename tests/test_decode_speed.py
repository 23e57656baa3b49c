"""The decode-speed benchmark: exact forward counts for its forced schedules, and its outputs."""

import json
import os
import subprocess
import sys

import pytest

from sbd_jax.architectures import tiny
from sbd_jax.benchmarks import decode_speed

REPO = os.path.dirname(os.path.dirname(__file__))


def test_forced_schedules_cost_exactly_their_forwards():
  cfg = tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  rows = decode_speed.fixed_schedule_rows(
    "micro",
    cfg,
    batches=[2],
    prompt_lens=[5],
    per_forward=[1, 3, 16],
    max_new_tokens=20,  # blocks of 16 and 4 tokens
    repeats=1,
    log=lambda _: None,
  )
  assert [r["schedule"] for r in rows] == ["r=1", "r=3", "r=16"]
  # EOS is disabled, so NTP makes 20 forwards and SBD ceil(16 / r) + ceil(4 / r).
  assert [r["nfe_speedup"] for r in rows] == [1.0, pytest.approx(20 / (6 + 2)), 10.0]
  assert [r["tokens_per_forward"] for r in rows] == [1.0, 2.5, 10.0]
  for r in rows:
    assert r["ntp_tokens_per_s"] > 0 and r["sbd_tokens_per_s"] > 0
    assert r["measured_speedup"] == pytest.approx(r["sbd_tokens_per_s"] / r["ntp_tokens_per_s"])
    assert r["measured_over_predicted"] == pytest.approx(
      r["measured_speedup"] / r["predicted_speedup"]
    )
  # More tokens per forward is predicted faster (same time(n), fewer forwards).
  assert rows[0]["predicted_speedup"] < rows[1]["predicted_speedup"] < rows[2]["predicted_speedup"]


def test_command_line_writes_rows_table_and_plot(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "sbd_jax.benchmarks.decode_speed",
      f"--out={tmp_path}",
      "--models=tiny",
      "--batches=1",
      "--prompt_lens=8",
      "--per_forward=4",
      "--max_new_tokens=16",
      "--repeats=1",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"),
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / "results.json") as f:
    (row,) = json.load(f)["rows"]
  for key in ("model", "batch", "schedule", "ntp_tokens_per_s", "sbd_tokens_per_s"):
    assert key in row
  assert row["model"] == "tiny" and row["schedule"] == "r=4" and row["nfe_speedup"] == 4.0
  assert "| tiny (" in (tmp_path / "decode_speed.md").read_text()
  assert (tmp_path / "decode_speed.png").stat().st_size > 0


def test_bad_flags_are_one_line():
  result = subprocess.run(
    [sys.executable, "-m", "sbd_jax.benchmarks.decode_speed", "--out=/tmp/x", "--models=huge"],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=120,
  )
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert "error: unknown model 'huge'" in result.stderr
