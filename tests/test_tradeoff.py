"""The accuracy / NFE-speedup figure: it draws what the evaluation summaries say."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import tradeoff

REPO = os.path.dirname(os.path.dirname(__file__))


def _summary(ntp, points):
  rows = [{"decoding": "ntp", "accuracy": ntp, "nfe_speedup": 1.0}]
  rows += [
    {"decoding": f"sbd eb_entropy γ={g}", "accuracy": a, "nfe_speedup": x} for g, a, x in points
  ]
  return {"task": "arithmetic", "decodings": rows}


def test_each_run_is_drawn_by_speedup_with_its_ntp_line(tmp_path):
  a = tmp_path / "a.json"
  a.write_text(json.dumps(_summary(1.0, [(0.35, 0.85, 11.4), (0.001, 0.998, 4.1)])))
  b = tmp_path / "b.json"
  b.write_text(json.dumps(_summary(0.99, [(0.1, 0.98, 12.9)])))
  runs = tradeoff.read_runs([f"cpu={a}", f"gpu, 8x={b}"])
  drawn = tradeoff.plot(runs, str(tmp_path / "t.png"))
  (panel,) = drawn.values()
  assert panel["cpu: SBD"] == ([4.1, 11.4], [pytest.approx(99.8), pytest.approx(85.0)])
  assert panel["gpu, 8x: SBD"] == ([12.9], [pytest.approx(98.0)])
  assert panel["cpu: NTP"][1] == [100.0, 100.0] and panel["gpu, 8x: NTP"][1] == [99.0, 99.0]
  assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
@pytest.mark.parametrize(
  "arg, message",
  [("nolabel", "is not LABEL=SUMMARY.json"), ("x={}", "is not an evaluate --json summary")],
)
def test_bad_arguments_fail_in_one_line(tmp_path, arg, message):
  other = tmp_path / "other.json"
  other.write_text("{}")
  result = subprocess.run(
    [sys.executable, "-m", "benchmarks.tradeoff", f"--out={tmp_path}/t.png",
     arg.format(other)],
    capture_output=True, text=True, cwd=REPO, timeout=120,
  )  # fmt: skip
  assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
  assert not (tmp_path / "t.png").exists()
