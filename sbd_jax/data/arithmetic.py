"""Built-in reasoning task: GSM8K-shaped word problems with worked, step-by-step solutions.

A problem tells a short story about one person's collection (a starting quantity, then gains and
losses) and ends in "The answer is N.". Two solution styles (`Difficulty.solution`):

"columns" (default): events are named by ordinals; the solution restates each event, works it
digit by digit (ones column first, the carry or borrow written out), then states the equation:

    Q: Mia has 52 pens. First, she buys 18 pens. Second, she sells 25 pens. How many pens does
    Mia have now?
    A: Mia has 52. First, she buys 18: 2+8=10, 5+1+1=7, so 52+18=70. Second, she sells 25:
    10-5=5, 7-2-1=4, so 70-25=45. The answer is 45.

"sentences": the events are told with varied phrasings, and the solution restates each one and
does it in a single equation (`Mia buys 18, so she has 52 + 18 = 70 pens.`).

Quantities are two-digit by default (totals in [10, 99]) and each event moves 2 to 29 of them,
so an answer takes two or three additions or subtractions with carries and borrows. Most of a
solution is predictable from what came before (restated events and quantities); the column
results are the genuine computation. Small models learn the columns style faster: each step is a
single-digit fact, and the ordinal tells the solution which event to restate.

Problems are generated in process from (split, index, seed, difficulty); nothing is downloaded.
A problem's split is decided by a seed-independent hash of its arithmetic (start value and every
operation), so no held-out problem's arithmetic appears in training, in any wording, style or
seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re

SPLITS = ("train", "eval")
SOLUTION_STYLES = ("columns", "sentences")
HELD_OUT_FRACTION = 1 / 16  # share of arithmetic signatures reserved for the eval split
_SALT = b"sbd-word-problems-v2"  # fixed: membership must not depend on the run's seed

_PEOPLE = (
  ("Mia", "She"),
  ("Leo", "He"),
  ("Ana", "She"),
  ("Ben", "He"),
  ("Cleo", "She"),
  ("Dan", "He"),
  ("Eva", "She"),
  ("Omar", "He"),
  ("Ivy", "She"),
  ("Sam", "He"),
  ("Zoe", "She"),
  ("Raj", "He"),
)
_ITEMS = ("apples", "pens", "cards", "coins", "books", "shells", "stamps", "marbles", "stickers")
# (event in the question, restatement in the solution); {n} quantity, {other} another person.
_GAINS = (
  ("{p} buys {n} more {item}.", "{p} buys {n}"),
  ("{p} finds {n} {item}.", "{p} finds {n}"),
  ("{p} gets {n} {item} from {other}.", "{p} gets {n} from {other}"),
  ("{other} gives {p_obj} {n} {item}.", "{p} gets {n} from {other}"),
)
_LOSSES = (
  ("{p} gives {n} {item} to {other}.", "{p} gives away {n}"),
  ("{p} loses {n} {item}.", "{p} loses {n}"),
  ("{p} sells {n} {item}.", "{p} sells {n}"),
  ("{other} takes {n} {item} from {p_obj}.", "{other} takes {n}"),
)
_OBJECT = {"She": "her", "He": "him"}
# The "columns" style's events: one verb per event, and an ordinal that names the event, so the
# solution can restate event i by matching its ordinal ("Second, she sells 13 pens.").
_GAIN_VERBS = ("buys", "finds", "wins", "gets")
_LOSS_VERBS = ("loses", "sells", "uses", "drops")
_ORDINALS = ("First", "Second", "Third", "Fourth", "Fifth", "Sixth", "Seventh", "Eighth", "Ninth")


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """Knobs of the task: operations per problem, the size of each event's amount, and the range
  every quantity (the start and each running total) stays in."""

  min_ops: int = 2  # operations per problem, drawn uniformly from [min_ops, max_ops]
  max_ops: int = 3
  min_operand: int = 2  # the amount gained or lost in one event
  max_operand: int = 29
  min_total: int = 10  # the start and every running total stay in [min_total, max_total]
  max_total: int = 99
  # How a solution works an operation: "columns" spells it out digit by digit (ones column
  # first, the carry or borrow written), then states it; "sentences" states it in one go.
  # Out of the repr, which seeds the draws: both styles render the same arithmetic per index.
  solution: str = dataclasses.field(default="columns", repr=False)

  @classmethod
  def of(cls, fields) -> "Difficulty":
    """From any object with these attributes (e.g. the `data.arithmetic` config group). A
    config saved before `solution` existed trained on "sentences"."""
    values = {f.name: getattr(fields, f.name, None) for f in dataclasses.fields(cls)}
    if values["solution"] is None:
      values["solution"] = "sentences"
    missing = [name for name, value in values.items() if value is None]
    if missing:
      raise ValueError(f"data.arithmetic lacks {missing}")
    return cls(**values)

  def __post_init__(self):
    if not 1 <= self.min_ops <= self.max_ops:
      raise ValueError(f"need 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
    if not 1 <= self.min_operand <= self.max_operand:
      raise ValueError(
        f"need 1 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}"
      )
    if self.solution not in SOLUTION_STYLES:
      raise ValueError(f"solution must be one of {SOLUTION_STYLES}, got {self.solution!r}")
    if self.solution == "columns" and self.max_ops > len(_ORDINALS):
      raise ValueError(f"the columns style names at most {len(_ORDINALS)} events (max_ops)")
    if not 0 <= self.min_total <= self.max_total - self.min_operand:
      raise ValueError(
        "need 0 <= min_total <= max_total - min_operand (room for one operation), got "
        f"{self.min_total}, {self.max_total}, {self.min_operand}"
      )


DEFAULT_DIFFICULTY = Difficulty()


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: the model sees `prompt` and should produce `completion`."""

  prompt: str
  completion: str
  answer: int

  @property
  def text(self) -> str:
    return self.prompt + self.completion


@dataclasses.dataclass(frozen=True)
class _Draw:
  start: int
  steps: tuple[tuple[str, int], ...]  # (op, operand) per event, op in "+-"


def _rng(*parts: object) -> random.Random:
  digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
  return random.Random(int.from_bytes(digest, "little"))


def _operation(r: random.Random, total: int, d: Difficulty) -> tuple[str, int]:
  """A gain or loss of at least min_operand that keeps the total in [min_total, max_total]."""
  can_gain = total + d.min_operand <= d.max_total
  can_lose = total - d.min_operand >= d.min_total
  op = r.choice("+-") if can_gain and can_lose else "+" if can_gain else "-"
  room = d.max_total - total if op == "+" else total - d.min_total
  return op, r.randint(d.min_operand, min(d.max_operand, room))


def _apply(total: int, op: str, n: int) -> int:
  return total + n if op == "+" else total - n


def _draw(r: random.Random, d: Difficulty) -> _Draw:
  """Start value and operations keeping every running total inside [min_total, max_total]."""
  total = r.randint(d.min_total, d.max_total)
  start, steps = total, []
  for _ in range(r.randint(d.min_ops, d.max_ops)):
    op, n = _operation(r, total, d)
    total = _apply(total, op, n)
    steps.append((op, n))
  return _Draw(start, tuple(steps))


def signature(draw: _Draw) -> str:
  """The problem's arithmetic, independent of names and wording."""
  return f"{draw.start}" + "".join(f"{op}{n}" for op, n in draw.steps)


def is_held_out(draw_signature: str) -> bool:
  digest = hashlib.blake2b(_SALT + draw_signature.encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2**64 < HELD_OUT_FRACTION


def _digits(n: int, width: int) -> list[int]:
  """The `width` lowest decimal digits of n, ones first."""
  return [n // 10**i % 10 for i in range(width)]


def _columns(a: int, op: str, b: int) -> str:
  """a op b worked column by column, ones first, each step one single-digit operation with the
  carry (or borrow) written out: 52 - 25 -> "12-5=7, 5-2-1=2"."""
  width = len(str(max(a, b)))
  steps, carry = [], 0
  for i, (x, y) in enumerate(zip(_digits(a, width), _digits(b, width))):
    if op == "+":
      value = x + y + carry
      lhs = f"{x}+{y}" if i == 0 else f"{x}+{y}+{carry}"
      steps.append(f"{lhs}={value}")
      carry = value // 10
    else:
      borrow = int(x - y - carry < 0)
      top = x + 10 * borrow
      lhs = f"{top}-{y}" if i == 0 else f"{top}-{y}-{carry}"
      steps.append(f"{lhs}={top - y - carry}")
      carry = borrow
  return ", ".join(steps)


def _render_columns(draw: _Draw, r: random.Random) -> Problem:
  """Events named by ordinals; the solution restates each event, works it column by column
  and states the equation."""
  (name, pron), item = r.choice(_PEOPLE), r.choice(_ITEMS)
  question, work = [f"{name} has {draw.start} {item}."], [f"{name} has {draw.start}."]
  total = draw.start
  for ordinal, (op, n) in zip(_ORDINALS, draw.steps):
    event = f"{ordinal}, {pron.lower()} {r.choice(_GAIN_VERBS if op == '+' else _LOSS_VERBS)} {n}"
    question.append(f"{event} {item}.")
    new_total = _apply(total, op, n)
    work.append(f"{event}: {_columns(total, op, n)}, so {total}{op}{n}={new_total}.")
    total = new_total
  question.append(f"How many {item} does {name} have now?")
  work.append(f"The answer is {total}.")
  return Problem(
    prompt=f"Q: {' '.join(question)}\nA:", completion=" " + " ".join(work), answer=total
  )


def _render_sentences(draw: _Draw, r: random.Random) -> Problem:
  (name, pron), item = r.choice(_PEOPLE), r.choice(_ITEMS)
  others = [p for p, _ in _PEOPLE if p != name]
  question = [f"{name} has {draw.start} {item}."]
  work = [f"{name} starts with {draw.start} {item}."]
  total = draw.start
  for i, (op, n) in enumerate(draw.steps):
    ask, restate = r.choice(_GAINS if op == "+" else _LOSSES)
    fields = dict(n=n, item=item, other=r.choice(others), p_obj=_OBJECT[pron])
    event = ask.format(p=pron if i == 0 else pron.lower(), **fields)
    question.append(("Then " + event) if i else event)
    new_total = _apply(total, op, n)
    work.append(
      f"{restate.format(p=pron, **fields)}, so {pron.lower()} has "
      f"{total} {op} {n} = {new_total} {item}."
    )
    total = new_total
  question.append(f"How many {item} does {name} have now?")
  work.append(f"The answer is {total}.")
  return Problem(
    prompt=f"Q: {' '.join(question)}\nA:", completion=" " + " ".join(work), answer=total
  )


def generate(
  split: str, index: int, seed: int, difficulty: Difficulty = DEFAULT_DIFFICULTY
) -> Problem:
  """Deterministic problem number `index` of `split` ("train" or "eval") for `seed`."""
  if split not in SPLITS:
    raise ValueError(f"unknown arithmetic split {split!r}; expected one of {SPLITS}")
  want_held_out = split == "eval"
  for attempt in range(10_000):
    r = _rng(seed, split, index, attempt, difficulty)
    draw = _draw(r, difficulty)
    if is_held_out(signature(draw)) == want_held_out:
      render = _render_columns if difficulty.solution == "columns" else _render_sentences
      return render(draw, r)
  raise RuntimeError("arithmetic generator failed to hit the requested split")  # unreachable


def drill(
  index: int, seed: int, difficulty: Difficulty = DEFAULT_DIFFICULTY, length: int = 8
) -> str:
  """A training document of `length` bare equations of the task's kind ("47 + 16 = 63."):
  the same operations as the word problems, practised more densely per token."""
  d = difficulty
  r = _rng(seed, "drill", index, difficulty)
  equations = []
  for _ in range(length):
    lhs = r.randint(d.min_total, d.max_total)
    op, n = _operation(r, lhs, d)
    equations.append(f"{lhs} {op} {n} = {_apply(lhs, op, n)}.")
  return " ".join(equations)


_ANSWER_RE = re.compile(r"The answer is (-?\d+)")


def extract_answer(text: str) -> int | None:
  """The integer after the first "The answer is" in `text`, or None if there is none."""
  match = _ANSWER_RE.search(text)
  return int(match.group(1)) if match else None


# An operation's stated result: "so she has 43 + 29 = 72" (sentences), "so 43+29=72" (columns).
_EQUATION_RE = re.compile(r"so (?:\w+ has )?(\d+) ?([-+]) ?(\d+) ?= ?(-?\d+)")
_COLUMNS_RE = re.compile(r": ([^a-z]*), so (\d+)([-+])(\d+)=")


def check_worked_solution(problem: Problem) -> bool:
  """True if every stated equation is correct, each starts from the previous result, the last
  result is the answer, and any column working is the operation's correct working."""
  equations = _EQUATION_RE.findall(problem.completion)
  if not equations:
    return False
  previous = None
  for lhs, op, rhs, res in equations:
    lhs, rhs, res = int(lhs), int(rhs), int(res)
    if _apply(lhs, op, rhs) != res or previous not in (None, lhs):
      return False
    previous = res
  for working, lhs, op, rhs in _COLUMNS_RE.findall(problem.completion):
    if working != _columns(int(lhs), op, int(rhs)):
      return False
  return previous == problem.answer == extract_answer(problem.completion)
