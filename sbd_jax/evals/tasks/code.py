"""HumanEval and MBPP: prompts, completion extraction, and the test program each completion runs.

Plain prompts follow the standard harnesses: HumanEval's prompt is the function's signature and
docstring, continued by the model and cut at the first top-level `def`/`class`/`if`/`print`/
comment (`HUMANEVAL_STOPS`); MBPP's prompt states the task and its tests and the code ends at
`[DONE]`. Chat prompts ask for a ```python block, and the first such block is the code.
"""

from __future__ import annotations

import re
from typing import Any

HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
MBPP_STOPS = ("[DONE]",)
_FENCE_RE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def fenced_code(text: str) -> str | None:
  """The first ``` fenced block of `text` (an unclosed fence runs to the end), or None."""
  match = _FENCE_RE.search(text)
  return match.group(1) if match else None


def cut_at_stops(text: str, stops: tuple[str, ...]) -> str:
  cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
  return text[:cut]


# HumanEval -------------------------------------------------------------------------------------


def humaneval_chat_prompt(record: dict[str, Any]) -> str:
  return (
    "Complete the following Python function. Reply with the complete function in a ```python "
    f"code block.\n```python\n{record['prompt']}```"
  )


def humaneval_program(record: dict[str, Any], completion: str) -> str:
  """The program whose exit status scores `completion`: the prompt, the completed function,
  the task's tests and `check(<entry point>)`."""
  code = fenced_code(completion)
  if code is None:  # a continuation of the prompt
    body = record["prompt"] + cut_at_stops(completion, HUMANEVAL_STOPS)
  elif re.search(rf"def\s+{re.escape(record['entry_point'])}\s*\(", code):
    body = record["prompt"] + "\n    pass\n\n" + code  # keeps the prompt's imports
  else:  # a fenced function body
    body = record["prompt"] + code
  return f"{body}\n\n{record['test']}\n\ncheck({record['entry_point']})\n"


# MBPP ------------------------------------------------------------------------------------------


# Three layouts: the original MBPP (`text`, `test_list`, `test_setup_code`), the sanitized MBPP
# (`prompt`, `test_list`, `test_imports`) and EvalPlus's MBPP+ (the sanitized fields plus `test`,
# a program that checks the function on the base and the extra inputs).


def mbpp_description(record: dict[str, Any]) -> str:
  return record["text"] if "text" in record else record["prompt"]


def _mbpp_tests(record: dict[str, Any]) -> str:
  return "\n".join(record["test_list"])


def _mbpp_setup(record: dict[str, Any]) -> str:
  if record.get("test_setup_code"):
    return record["test_setup_code"]
  return "\n".join(record.get("test_imports") or ())


def mbpp_plain_prompt(record: dict[str, Any]) -> str:
  """The MBPP paper's prompt (zero-shot): the task, its tests, then [BEGIN]."""
  return (
    f"You are an expert Python programmer, and here is your task: {mbpp_description(record)} Your code "
    f"should pass these tests:\n\n{_mbpp_tests(record)}\n[BEGIN]\n"
  )


def mbpp_chat_prompt(record: dict[str, Any]) -> str:
  return (
    f"{mbpp_description(record)}\nYour code should pass these tests:\n\n{_mbpp_tests(record)}\n\n"
    "Reply with the code in a ```python code block."
  )


def mbpp_program(record: dict[str, Any], completion: str) -> str:
  """The program whose exit status scores `completion`: the code, the test setup, the shown asserts
  and, for MBPP+, its extra test program."""
  code = fenced_code(completion)
  if code is None:
    code = cut_at_stops(completion, MBPP_STOPS)
  plus = record.get("test") or ""
  return f"{code}\n\n{_mbpp_setup(record)}\n{_mbpp_tests(record)}\n{plus}\n"
