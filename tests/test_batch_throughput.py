"""The batch-throughput benchmark end to end on a random-weight workdir: its counts and files."""

import json
import os
import subprocess
import sys

import pytest
from run_helpers import untrained_workdir  # tests/ is on sys.path

from benchmarks import batch_throughput
from sbd_jax import config as config_lib
from sbd_jax.model.architectures import tiny

pytestmark = pytest.mark.integration  # a toy batch-throughput run

REPO = os.path.dirname(os.path.dirname(__file__))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("run"))
  c = config_lib.base_config(
    tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  )
  c.sample.max_new_tokens = 12
  c.sample.block_size = 4
  return untrained_workdir(path, c)


def _run(*args):
  command = [sys.executable, "-m", "benchmarks.batch_throughput", *args]
  return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)


def test_toy_run_counts_forwards_per_batch_size(workdir, tmp_path):
  out = tmp_path / "bt"
  result = _run(
    f"--workdir={workdir}", f"--out={out}", "--batches=1,3", "--problems=6", "--gammas=2",
    "--repeats=1",
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-2000:]
  rows = json.loads((out / "results.json").read_text())["rows"]
  by = {(r["batch"], r["decoding"]): r for r in rows}
  names = ("NTP", "SBD γ=2 lockstep", "SBD γ=2 alone", "NTP refill", "SBD γ=2 refill")
  assert set(by) == {(b, d) for b in (1, 3) for d in names}
  for b in (1, 3):
    ntp, lockstep, alone, ntp_refill, refill = (by[b, name] for name in names)
    assert ntp["wide_forwards"] == 0 and ntp["forwards_vs_ntp"] == 1.0
    assert ntp["prefills"] == lockstep["prefills"] == alone["prefills"] == -(-6 // b)
    # The same rows decode the same tokens either way; rows moving alone never wait.
    assert alone["tokens"] == lockstep["tokens"] and alone["mean_nfe"] == lockstep["mean_nfe"]
    assert alone["batch_forwards"] <= lockstep["batch_forwards"]
    assert 0 < lockstep["rows_busy"] <= alone["rows_busy"] <= 1
    # Refill: the same tokens and NFE, one single-row prefill per problem.
    for plain, queued in ((ntp, ntp_refill), (alone, refill)):
      assert queued["tokens"] == plain["tokens"] and queued["mean_nfe"] == plain["mean_nfe"]
      assert queued["prefills"] == 6 and queued["refill"] and not plain["refill"]
    assert ntp_refill["forwards_vs_ntp"] == 1.0  # each refill row is compared with NTP refill
    for r in (ntp, lockstep, alone, ntp_refill, refill):
      assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["median_s"])
  # One row per batch: every forward serves it, and both SBD decodings are one program.
  for name in ("NTP", "SBD γ=2 alone"):
    assert by[1, name]["rows_busy"] == 1.0
    assert by[1, name]["batch_forwards"] == pytest.approx(6 * by[1, name]["mean_nfe"])
  assert by[1, "SBD γ=2 alone"]["batch_forwards"] == by[1, "SBD γ=2 lockstep"]["batch_forwards"]
  table = (out / "batch_throughput.md").read_text().splitlines()
  assert len(table) == 2 + len(rows)
  assert (out / "batch_throughput.png").read_bytes()[:4] == b"\x89PNG"
  drawn = batch_throughput.plot(rows, str(tmp_path / "again.png"))  # what the figure shows
  for name in names:
    line = [by[b, name] for b in (1, 3)]
    assert drawn["generated tokens per second"][name] == (
      [1.0, 3.0],
      [r["tokens_per_s"] for r in line],
    )
    assert drawn["rows busy %"][name][1] == [100 * r["rows_busy"] for r in line]


def test_a_missing_workdir_is_one_line(tmp_path):
  result = _run(f"--workdir={tmp_path / 'nowhere'}", f"--out={tmp_path / 'out'}")
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1
