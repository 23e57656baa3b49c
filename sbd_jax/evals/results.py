"""One result schema for every evaluation, and its views.

A record is one (decoding, problem): `task_id`, `decoding`, `completion`, `tokens`, `nfe`,
`row_forwards`, `rollbacks`, `drafts`, `draft_tokens`, `accepted_tokens`,
`accepted_by_position`, `finished`, `correct`, `extracted`. `summarize` turns records into a
summary, one entry per decoding: accuracy with its 95 % Wilson interval, mean forwards, NFE
speedup (mean over problems of NTP forwards / the decoding's, each counted up to its EOS), the
tokens kept per forward (all problems' tokens / all their forwards), the rejected drafts per
problem, verified decodings' acceptance as serving stacks report speculative decoding's
(`acceptance`), the paired difference to NTP on the same problems, and the share of
row-forwards that served a row still decoding. `format_table` prints one summary;
`format_markdown` sets several tasks side by side as the paper's Table 1 does;
`dashboard_scalars` names the numbers for TensorBoard / W&B.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sbd_jax.decode.acceptance import summary
from sbd_jax.evals import stats

NTP = "ntp"


def summarize(
  records: Sequence[dict[str, Any]], task_ids: Sequence[str], decodings: Sequence[str]
) -> list[dict[str, Any]]:
  """Per decoding, its numbers over `task_ids` (every pair must have a record)."""
  by_key = {(r["decoding"], r["task_id"]): r for r in records}
  picked = {name: [by_key[(name, t)] for t in task_ids] for name in decodings}
  ntp_correct = np.asarray([r["correct"] for r in picked[NTP]], bool)
  ntp_nfe = np.asarray([r["nfe"] for r in picked[NTP]], float)
  rows = []
  for name in decodings:
    correct = np.asarray([r["correct"] for r in picked[name]], bool)
    nfe = np.asarray([r["nfe"] for r in picked[name]], float)
    row_forwards = np.asarray([r["row_forwards"] for r in picked[name]], float)
    tokens = np.asarray([r["tokens"] for r in picked[name]], float)
    rollbacks = np.asarray([r.get("rollbacks", 0) for r in picked[name]], float)
    rows.append(
      {
        "decoding": name,
        "accuracy": float(correct.mean()),
        "ci95": list(stats.wilson_interval(int(correct.sum()), len(correct))),
        "mean_nfe": float(nfe.mean()),
        "nfe_speedup": float(np.mean(ntp_nfe / np.maximum(nfe, 1))),
        "tokens_per_forward": float(tokens.sum() / max(nfe.sum(), 1)),
        "rollbacks": float(rollbacks.mean()),
        "acceptance": acceptance(picked[name]),
        "minus_ntp": None if name == NTP else stats.paired_difference(correct, ntp_correct),
        "rows_busy": stats.rows_busy(nfe, row_forwards),
      }
    )
  return rows


def acceptance(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
  """Verified drafts over `records` (`decode.acceptance.summary`); None without drafts."""
  records = [r for r in records if r.get("drafts")]
  if not records:
    return None
  return summary(
    sum(r["drafts"] for r in records),
    sum(r["draft_tokens"] for r in records),
    sum(r["accepted_tokens"] for r in records),
    np.sum([r["accepted_by_position"] for r in records], axis=0),
  )


def _pct(x: float) -> str:
  return f"{100 * x:.1f}"


def format_table(summary: dict[str, Any]) -> str:
  """Fixed-width text: a line saying what was decoded, then one row per decoding."""
  seed = f" (seed {summary['seed']})" if summary.get("seed") is not None else ""
  how = f"temperature {summary['temperature']:g}" if summary.get("temperature") else "greedy"
  lines = [
    f"{summary['task']}: {summary['num_problems']} problems{seed}, block size "
    f"{summary['block_size']}, at most {summary['max_new_tokens']} new tokens, {how}",
    f"{'decoding':<33} {'accuracy %':>10} {'95% CI':>13} {'vs NTP (95% CI)':>21} "
    f"{'mean forwards':>14} {'NFE speedup':>12} {'tokens/fwd':>11} {'rows busy %':>12} "
    f"{'accepted %':>11} {'accept len':>11}",
  ]
  for r in summary["decodings"]:
    ci = f"[{_pct(r['ci95'][0])}, {_pct(r['ci95'][1])}]"
    d = r["minus_ntp"]
    diff = "" if d is None else f"{100 * d['mean']:+.1f} [{100 * d['ci95'][0]:+.1f}, "
    diff += "" if d is None else f"{100 * d['ci95'][1]:+.1f}]"
    lines.append(
      f"{r['decoding']:<33} {_pct(r['accuracy']):>10} {ci:>13} {diff:>21} "
      f"{r['mean_nfe']:>14.1f} {r['nfe_speedup']:>11.2f}x {r.get('tokens_per_forward', 0):>11.2f} "
      f"{_pct(r['rows_busy']):>12}{_acceptance_cells(r.get('acceptance'))}"
    )
  return "\n".join(lines)


def _acceptance_cells(a: dict[str, Any] | None) -> str:
  if a is None:
    return ""
  return f" {_pct(a['acceptance_rate']):>11} {a['mean_acceptance_length']:>11.2f}"


def format_markdown(summaries: Sequence[dict[str, Any]]) -> str:
  """Markdown, one row per decoding and one column per task: accuracy % (NFE speedup)."""
  names = list(dict.fromkeys(r["decoding"] for s in summaries for r in s["decodings"]))
  header = "| decoding | " + " | ".join(f"{s['task']} ({s['num_problems']})" for s in summaries)
  lines = [header + " |", "|---" * (len(summaries) + 1) + "|"]
  for name in names:
    cells = []
    for s in summaries:
      r = next((r for r in s["decodings"] if r["decoding"] == name), None)
      if r is None:
        cells.append("")
      elif name == NTP:
        cells.append(_pct(r["accuracy"]))
      else:
        cells.append(f"{_pct(r['accuracy'])} ({r['nfe_speedup']:.2f}x)")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def dashboard_scalars(summary: dict[str, Any]) -> dict[str, float]:
  """Accuracy per decoding and NFE speedup per SBD decoding, named for TensorBoard / W&B:
  `ntp_accuracy`, `sbd_eb_entropy_gamma0.35_accuracy`, `..._nfe_speedup`."""
  scalars = {}
  for r in summary["decodings"]:
    words = r["decoding"].split()
    name = "ntp" if r["decoding"] == NTP else "_".join(words).replace("γ=", "gamma")
    scalars[f"{name}_accuracy"] = r["accuracy"]
    if r["decoding"] != NTP:
      scalars[f"{name}_nfe_speedup"] = r["nfe_speedup"]
  return {k: v for k, v in scalars.items() if math.isfinite(v)}
