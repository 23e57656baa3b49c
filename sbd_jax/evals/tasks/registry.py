"""Every task by name: the built-in arithmetic problems, the benchmark files and your own
JSONL prompt/completion pairs scored by exact match."""

from __future__ import annotations

from sbd_jax.evals.tasks import arithmetic, exact
from sbd_jax.evals.tasks.benchmarks import BENCHMARKS
from sbd_jax.evals.tasks.task import Task

TASKS: dict[str, Task] = {"arithmetic": arithmetic.TASK, **BENCHMARKS, "exact": exact.TASK}


def get(name: str) -> Task:
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
  return TASKS[name]
