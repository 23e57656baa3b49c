"""The benchmark tasks, read from local files in their public formats and scored like the
standard harnesses: GSM8K, MATH500, HumanEval(+) and MBPP.

task = tasks.get("gsm8k")
    problems = task.load("gsm8k_test.jsonl", limit=100)
    prompt = problems[0].plain_prompt      # or problems[0].chat_message, for a chat template
    scores = task.score(problems, completions)   # [{"correct": bool, "extracted": ...}, ...]

| task | fields read | prompt | correct when |
|---|---|---|---|
| gsm8k | question, answer (`#### N`) | `Question: ...\\nAnswer:` | the final number equals N |
| math500 | problem, answer | `Problem: ...\\nSolution:` | the last `\\boxed{}` equals the answer |
| humaneval | task_id, prompt, test, entry_point | the function stub | its tests pass (sandboxed) |
| mbpp | task_id, text or prompt, test_list | MBPP paper's [BEGIN] prompt | its asserts pass (sandboxed) |
|  (MBPP+) | ... and test | the same | its asserts and its `test` program pass |

Chat-templated models get the `chat_message` as a user turn (math tasks ask for the final answer
in `\\boxed{}`; code tasks for a ```python block). Code runs only through `tasks.execution`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sbd_jax.evals.tasks import answers, code, execution
from sbd_jax.evals.tasks.records import TaskDataError
from sbd_jax.evals.tasks.task import Problem, Task

_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _id(record: dict[str, Any], index: int, task: str, key: str = "task_id") -> str:
  return str(record[key]) if key in record else f"{task}/{index}"


# Math ------------------------------------------------------------------------------------------


def _gsm8k_problem(record: dict[str, Any], index: int) -> Problem:
  answers.gsm8k_reference(record["answer"])  # fails early on a malformed reference
  question = record["question"].strip()
  return Problem(
    _id(record, index, "gsm8k"),
    f"Question: {question}\nAnswer:",
    f"{question}\n{_MATH_INSTRUCTION}",
    record,
  )


def _gsm8k_grade(problems, completions, limits) -> list[dict[str, Any]]:
  del limits
  out = []
  for p, text in zip(problems, completions):
    predicted = answers.extract_number(text)
    reference = answers.gsm8k_reference(p.record["answer"])
    out.append({"correct": answers.numbers_equal(predicted, reference), "extracted": predicted})
  return out


def _math500_problem(record: dict[str, Any], index: int) -> Problem:
  problem = record["problem"].strip()
  return Problem(
    _id(record, index, "math500", key="unique_id"),
    f"Problem: {problem}\nSolution:",
    f"{problem}\n{_MATH_INSTRUCTION}",
    record,
  )


def _math500_grade(problems, completions, limits) -> list[dict[str, Any]]:
  del limits
  out = []
  for p, text in zip(problems, completions):
    predicted = answers.last_boxed(text)
    out.append(
      {"correct": answers.math_equal(predicted, str(p.record["answer"])), "extracted": predicted}
    )
  return out


# Code ------------------------------------------------------------------------------------------


def _humaneval_problem(record: dict[str, Any], index: int) -> Problem:
  return Problem(
    _id(record, index, "humaneval"), record["prompt"], code.humaneval_chat_prompt(record), record
  )


def _mbpp_problem(record: dict[str, Any], index: int) -> Problem:
  if not isinstance(record["test_list"], list):
    raise TaskDataError(f"MBPP record {index}: test_list must be a list of assert strings")
  if "text" not in record and "prompt" not in record:
    raise TaskDataError(
      f"MBPP record {index}: no task description; expected `text` (MBPP) or `prompt` "
      f"(sanitized MBPP, MBPP+), the record has {sorted(record)}"
    )
  return Problem(
    _id(record, index, "mbpp"),
    code.mbpp_plain_prompt(record),
    code.mbpp_chat_prompt(record),
    record,
  )


def _run_tests(program: Callable[[dict[str, Any], str], str]):
  def grade(problems, completions, limits) -> list[dict[str, Any]]:
    programs = [program(p.record, text) for p, text in zip(problems, completions)]
    results = execution.run_programs(programs, limits)
    return [{"correct": r.passed, "extracted": r.status, "detail": r.detail} for r in results]

  return grade


BENCHMARKS = {
  # A plain-prompted model may go on to write the next question itself: cut there.
  "gsm8k": Task(
    "gsm8k", ("question", "answer"), _gsm8k_problem, _gsm8k_grade, 512, ("\nQuestion:",)
  ),
  "math500": Task(
    "math500", ("problem", "answer"), _math500_problem, _math500_grade, 1024, ("\nProblem:",)
  ),
  "humaneval": Task(
    "humaneval",
    ("task_id", "prompt", "test", "entry_point"),
    _humaneval_problem,
    _run_tests(code.humaneval_program),
    512,
    code.HUMANEVAL_STOPS,
  ),
  "mbpp": Task(
    "mbpp",
    ("task_id", "test_list"),
    _mbpp_problem,
    _run_tests(code.mbpp_program),
    512,
    code.MBPP_STOPS,
  ),
}
