"""Accuracy against NFE speedup of one or more evaluated runs: one line per run through its SBD
decodings (one point per γ), and each run's NTP accuracy as a dashed line of the same colour.

    python -m sbd_jax.evaluate --workdir=RUN --gammas=0.001,0.01,0.1,0.35 --json > RUN.json
    python -m benchmarks.tradeoff --out=tradeoff.png LABEL=RUN.json [LABEL=RUN2.json ...]

The inputs are `evaluate --json` summaries of one task each; runs evaluated on the same problems
compare point for point.
"""

from __future__ import annotations

import json
import re
from typing import Any

from absl import flags

from benchmarks import report
from sbd_jax import cli

_GAMMA = re.compile(r"γ=([0-9.eE+-]+)")


def read_runs(specs: list[str]) -> dict[str, dict[str, Any]]:
  """{label: summary} from LABEL=PATH arguments."""
  runs = {}
  for spec in specs:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
      raise ValueError(f"argument {spec} is not LABEL=SUMMARY.json")
    with open(path, encoding="utf-8") as f:
      summary = json.load(f)
    if "decodings" not in summary:
      raise ValueError(f"{path} is not an evaluate --json summary (no 'decodings')")
    runs[label] = summary
  return runs


def plot(runs: dict[str, dict[str, Any]], path: str) -> report.Series:
  """Draw the runs to `path`; returns the drawn series (`report.drawn`)."""
  with report.figure(path, 1, size=(6.0, 4.2)) as (ax,):
    for i, (label, summary) in enumerate(runs.items()):
      sbd = sorted(
        (r for r in summary["decodings"] if r["decoding"] != "ntp"),
        key=lambda r: r["nfe_speedup"],
      )
      color = f"C{i}"
      ax.plot(
        [r["nfe_speedup"] for r in sbd],
        [100 * r["accuracy"] for r in sbd],
        "o-",
        color=color,
        label=f"{label}: SBD",
      )
      for r in sbd:
        gamma = _GAMMA.search(r["decoding"])
        if gamma:
          ax.annotate(
            gamma.group(1),
            (r["nfe_speedup"], 100 * r["accuracy"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(3, -9),
            color=color,
          )
      ntp = [r for r in summary["decodings"] if r["decoding"] == "ntp"]
      if ntp:
        ax.axhline(100 * ntp[0]["accuracy"], color=color, ls="--", lw=1, label=f"{label}: NTP")
    task = next(iter(runs.values())).get("task", "")
    ax.set_title(f"{task}: accuracy against fewer forwards (γ labelled)")
    ax.set_xlabel("NFE speedup over NTP decoding (x)")
    ax.set_ylabel("accuracy %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return report.drawn([ax])


def main(argv):
  try:
    runs = read_runs(argv[1:])
    if not runs:
      raise ValueError("give at least one LABEL=SUMMARY.json")
  except (OSError, ValueError) as e:
    cli.fail(e)
  plot(runs, flags.FLAGS.out)
  print(f"wrote {flags.FLAGS.out}")


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "The figure's path (.png).", required=True)
  cli.run(main)
