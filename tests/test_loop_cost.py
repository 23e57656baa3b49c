"""The loop-cost benchmark: per-forward decode costs as slopes between decodes of known
forward counts, next to time(n)."""

import os
import subprocess
import sys

import pytest

from sbd_jax.benchmarks import loop_cost

REPO = os.path.dirname(os.path.dirname(__file__))


def test_slopes_compare_decodes_that_differ_only_in_their_forwards():
  r = loop_cost.loop_cost("tiny", prompt_len=5, max_new_tokens=64, repeats=1, min_total_s=0.0)
  ntp, later, wide = r["ntp_forward"], r["sbd_later_pass"], r["sbd_wide_pass"]
  # NTP: 64 against 32 tokens. Later passes: r = 1 against r = 2 over 4 blocks of 16, 15
  # against 7 per block. Wide passes: r = 16, 3 against 1 (every block after the first).
  assert [x["extra_forwards"] for x in (ntp, later, wide)] == [32, 32, 2]
  assert [x["n"] for x in (ntp, later, wide)] == [1, 16, 32]
  for x in (ntp, later, wide):
    assert x["over_loop"] == pytest.approx(x["decode_s"] / x["time_s"])
    assert x["fastest_over_loop"] == pytest.approx(x["fastest_decode_s"] / x["fastest_time_s"])
    long, short = x["decodes_min_s"]
    assert x["fastest_decode_s"] == pytest.approx((long - short) / x["extra_forwards"])
  # Every decode over one cache of 16 + 64 slots: a single attention chunk (the tiny model's
  # chunk is 176), so time(n) is timed at one fill: the middle of the slots past the 16-slot
  # bucket that the extra forwards' keys reach, less the n new tokens. NTP's second half and
  # the wide passes of blocks 2 and 3 reach (32, 64], every block's later passes (0, 64].
  assert r["cache_length"] == 16 + 64
  assert [x["fill_steps"] for x in (ntp, later, wide)] == [
    [[16 + 48 - 1, 1.0, ntp["time_s"]]],
    [[16 + 32 - 16, 1.0, later["time_s"]]],
    [[16 + 48 - 32, 1.0, wide["time_s"]]],
  ]
  table = loop_cost.format_markdown([r]).splitlines()
  assert len(table) == 2 + 3 and table[2].startswith(
    "| tiny (0.8M) | 5 | 64 | NTP forward, n = 1 |"
  )


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
