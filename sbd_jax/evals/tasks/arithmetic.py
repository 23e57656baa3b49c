"""The built-in task: held-out arithmetic word problems (`sbd_jax.data.arithmetic`), drawn per
seed from a run's data config, never seen in training, scored by their final answer.

Problems have no data file: `problems(data_cfg, n, seed)` draws them. The decode budget is the
longest reference solution, rounded up to whole blocks (`Task.max_new_tokens = 0`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_collections

from sbd_jax.data import arithmetic
from sbd_jax.data.pipeline import make_eval_problems
from sbd_jax.evals.tasks import execution
from sbd_jax.evals.tasks.task import Problem, Task


def problems(data_cfg: ml_collections.ConfigDict, n: int, seed: int) -> list[Problem]:
  """The first `n` held-out problems of `seed` (task ids `arithmetic/<seed>/<index>`)."""
  return [
    Problem(
      task_id=f"arithmetic/{seed}/{i}",
      plain_prompt=p.prompt,
      chat_message=p.prompt,
      record={"completion": p.completion, "answer": p.answer},
    )
    for i, p in enumerate(make_eval_problems(data_cfg, n, seed))
  ]


def _grade(
  problems: Sequence[Problem], completions: Sequence[str], limits: execution.Limits
) -> list[dict[str, Any]]:
  del limits
  out = []
  for p, text in zip(problems, completions):
    answer = arithmetic.extract_answer(text)
    out.append({"correct": answer == p.record["answer"], "extracted": answer})
  return out


TASK = Task("arithmetic", fields=(), to_problem=None, grade=_grade, max_new_tokens=0)
