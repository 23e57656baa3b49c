"""Your own task as JSONL: {"prompt": ..., "completion": ...} records (the format `data.source =
"jsonl"` trains on), a completion correct when it equals the reference, whitespace at either
end aside. For tasks whose answer the prompt determines: a copy, a reversal, a mapping.

    python -m sbd_jax.evaluate --workdir=DIR --task=exact --data=held_out.jsonl

The decode budget is the longest reference completion with its EOS, in whole blocks.
"""

from __future__ import annotations

from typing import Any

from sbd_jax.evals.tasks.task import Problem, Task


def _problem(record: dict[str, Any], index: int) -> Problem:
  task_id = str(record.get("task_id", f"exact/{index}"))
  return Problem(task_id, record["prompt"], record["prompt"], record)


def _grade(problems, completions, limits) -> list[dict[str, Any]]:
  del limits
  return [
    {"correct": text.strip() == str(p.record["completion"]).strip(), "extracted": text.strip()}
    for p, text in zip(problems, completions)
  ]


TASK = Task("exact", ("prompt", "completion"), _problem, _grade, max_new_tokens=0)
