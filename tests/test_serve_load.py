"""The load benchmark's arithmetic (`benchmarks.serve_load.summary`): vLLM's serving numbers
from timed streams, checked against values worked out by hand."""

import pytest

from benchmarks.serve_load import Answer, format_markdown, summary


def test_summary_is_vllms_numbers_worked_by_hand():
  answers = [
    Answer(chunk_s=[0.1, 0.3, 0.6], latency_s=0.6, tokens=9, forwards=3),  # 3 blocks of 3
    Answer(chunk_s=[0.2, 0.4], latency_s=0.5, tokens=5, forwards=4),
    Answer(chunk_s=[], latency_s=0.05, tokens=0, forwards=1),  # EOS at once: no text
  ]
  s = summary(answers, wall_s=2.0)
  assert s["requests"] == 3 and s["request_throughput"] == pytest.approx(1.5)
  assert s["tokens_per_s"] == pytest.approx(7.0) and s["tokens_per_request"] == pytest.approx(
    14 / 3
  )
  assert s["forwards_per_token"] == pytest.approx(8 / 14)
  assert s["ttft_mean_s"] == pytest.approx((0.1 + 0.2 + 0.05) / 3)
  assert s["ttft_p50_s"] == pytest.approx(0.1)
  # TPOT: (latency - TTFT) / (tokens - 1) per request with at least 2 tokens.
  tpots = [(0.6 - 0.1) / 8, (0.5 - 0.2) / 4]
  assert s["tpot_mean_s"] == pytest.approx(sum(tpots) / 2)
  # ITL: every gap between chunks of a request, pooled.
  gaps = [0.2, 0.3, 0.2]
  assert s["itl_mean_s"] == pytest.approx(sum(gaps) / 3) and s["itl_p50_s"] == pytest.approx(0.2)
  assert s["itl_p99_s"] == pytest.approx(0.2 + 0.98 * 0.1)  # linear between the order stats
  assert s["e2e_p99_s"] == pytest.approx(0.5 + 0.98 * 0.1)
  row = {**s, "continuous": True, "decoding": "sbd verified", "concurrency": 4}
  line = format_markdown([row]).splitlines()[-1]
  assert line.startswith("| continuous | sbd verified | 4 | 3 | 1.50 | 7 | 5 |")
