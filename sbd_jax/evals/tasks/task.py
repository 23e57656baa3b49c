"""What a task is: how its problems are read, prompted and scored."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from sbd_jax.evals.tasks import execution
from sbd_jax.evals.tasks.records import TaskDataError, read_jsonl


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem as every task presents it."""

  task_id: str
  plain_prompt: str  # for models without a chat template: the text they continue
  chat_message: str  # for chat models: the user turn
  record: dict[str, Any] = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class Task:
  """How one benchmark is read, prompted and scored."""

  name: str
  fields: tuple[str, ...]  # required in every record
  to_problem: Callable[[dict[str, Any], int], Problem] | None
  grade: Callable[[Sequence[Problem], Sequence[str], execution.Limits], list[dict[str, Any]]]
  # Default decode budget; 0: the longest reference completion (`record["completion"]`, with
  # its EOS) rounded up to whole blocks.
  max_new_tokens: int
  stops: tuple[str, ...] = ()  # plain-prompt completions end at the first of these

  def load(self, path: str, limit: int | None = None) -> list[Problem]:
    """The first `limit` problems of a JSONL file (plain or .gz) in the benchmark's format."""
    if self.to_problem is None:
      raise ValueError(f"the {self.name} task has no data file: its problems are drawn")
    records = read_jsonl(path, self.fields)
    problems = [self.to_problem(r, i) for i, r in enumerate(records[:limit])]
    ids = [p.task_id for p in problems]
    if len(set(ids)) != len(ids):
      duplicate = next(i for i in ids if ids.count(i) > 1)
      raise TaskDataError(f"{path}: task_id {duplicate!r} appears more than once")
    return problems

  def score(
    self,
    problems: Sequence[Problem],
    completions: Sequence[str],
    limits: execution.Limits = execution.DEFAULT_LIMITS,
  ) -> list[dict[str, Any]]:
    """One {"correct": bool, "extracted": ...} per problem."""
    if len(problems) != len(completions):
      raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    return self.grade(problems, completions, limits)
