"""The loop-cost benchmark: per-forward decode costs as slopes between decodes of known
forward counts, next to time(n)."""

import os
import subprocess
import sys

import pytest

from sbd_jax.benchmarks import loop_cost

REPO = os.path.dirname(os.path.dirname(__file__))


def test_slopes_compare_decodes_that_differ_only_in_their_forwards():
  r = loop_cost.loop_cost("tiny", prompt_len=5, max_new_tokens=32, repeats=1, min_total_s=0.0)
  # r = 1 against r = 2 over 2 blocks of 16: 15 against 7 later passes per block.
  assert r["sbd_extra_later_passes"] == 16
  assert set(r["decode_median_s"]) == {"ntp", "ntp_half", "sbd_r1", "sbd_r2"}
  assert r["ntp_over_loop"] == pytest.approx(r["ntp_forward_s"] / r["time1_s"])
  assert r["sbd_over_loop"] == pytest.approx(r["sbd_later_pass_s"] / r["time16_s"])
  # time(n) over the decodes' caches at their forwards' mean fill: the 16-slot prompt bucket
  # and 3/4 of NTP's 32 tokens (its second half), half of SBD's.
  assert r["time_cached_tokens"] == {"1": 16 + 24, "16": 16 + 16}
  table = loop_cost.format_markdown([r]).splitlines()
  assert len(table) == 3 and table[2].startswith("| tiny (0.8M) | 5 | 32 |")


def test_bad_new_tokens_are_one_line():
  result = subprocess.run(
    [sys.executable, "-m", "sbd_jax.benchmarks.loop_cost", "--out=/tmp/x", "--max_new_tokens=40"],
    capture_output=True,
    text=True,
    cwd=REPO,
    timeout=120,
  )
  assert result.returncode != 0 and "Traceback" not in result.stderr
  assert "--max_new_tokens=40: needs a multiple of 16, at least 32" in result.stderr
