"""Built-in synthetic reasoning task: short arithmetic word problems with worked solutions.

Problems are generated in process from (split, index, seed); nothing is downloaded. A problem's
split is decided by a seed-independent hash of its equations, so no held-out problem's arithmetic
ever appears in train, in any wording and under any seed.
"""

import dataclasses
import hashlib
import random
import re

SPLITS = ("train", "eval")
HELD_OUT_FRACTION = 1 / 16  # share of equation signatures reserved for the eval split
_SALT = b"sbd-arith-v1"  # fixed: membership must not depend on the run's seed

_NAMES = (
  ("Ana", "She"),
  ("Ben", "He"),
  ("Cleo", "She"),
  ("Dan", "He"),
  ("Eva", "She"),
  ("Omar", "He"),
)
_OBJECTS = ("pens", "apples", "cards", "coins", "books", "shells")


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
  prompt: str
  steps: tuple[tuple[int, str, int, int], ...]  # (lhs, op, rhs, result) per step


def _rng(*parts: object) -> random.Random:
  digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
  return random.Random(int.from_bytes(digest, "little"))


def _step(lhs: int, op: str, rhs: int) -> tuple[int, str, int, int]:
  result = {"+": lhs + rhs, "-": lhs - rhs, "*": lhs * rhs, "/": lhs // rhs}[op]
  return (lhs, op, rhs, result)


def _buy_give(r: random.Random, name: str, pron: str, obj: str) -> _Draw:
  a, b = r.randint(2, 60), r.randint(2, 39)
  c = r.randint(1, min(99, a + b))
  s1 = _step(a, "+", b)
  prompt = f"{name} has {a} {obj}. {pron} buys {b} and gives away {c}. How many {obj} now?"
  return _Draw(prompt, (s1, _step(s1[3], "-", c)))


def _boxes_lose(r: random.Random, name: str, pron: str, obj: str) -> _Draw:
  a, b = r.randint(2, 9), r.randint(2, 11)
  c = r.randint(1, a * b)
  s1 = _step(a, "*", b)
  prompt = f"{name} has {a} boxes of {b} {obj}. {pron} loses {c}. How many {obj} now?"
  return _Draw(prompt, (s1, _step(s1[3], "-", c)))


def _find_split(r: random.Random, name: str, pron: str, obj: str) -> _Draw:
  c, q = r.randint(2, 9), r.randint(2, 11)
  total = c * q
  a = r.randint(1, total - 1)
  s1 = _step(a, "+", total - a)
  del pron
  prompt = f"{name} has {a} {obj}, finds {total - a} and makes {c} equal piles. How many per pile?"
  return _Draw(prompt, (s1, _step(total, "/", c)))


def _three_steps(r: random.Random, name: str, pron: str, obj: str) -> _Draw:
  a, b = r.randint(2, 50), r.randint(2, 30)
  c, d = r.randint(1, a + b), r.randint(2, 20)
  s1 = _step(a, "+", b)
  s2 = _step(s1[3], "-", c)
  prompt = f"{name} has {a} {obj}, gets {b}, loses {c}, then finds {d}. How many now?"
  return _Draw(prompt, (s1, s2, _step(s2[3], "+", d)))


_TEMPLATES = (_buy_give, _boxes_lose, _find_split, _three_steps)


def _signature(draw: _Draw) -> str:
  """Canonical parameters of a problem: its equations, independent of names and wording."""
  return "|".join(f"{lhs}{op}{rhs}" for lhs, op, rhs, _ in draw.steps)


def is_held_out(draw_signature: str) -> bool:
  digest = hashlib.blake2b(_SALT + draw_signature.encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2**64 < HELD_OUT_FRACTION


def _render(draw: _Draw) -> Problem:
  work = " ".join(f"{lhs}{op}{rhs}={res}." for lhs, op, rhs, res in draw.steps)
  answer = draw.steps[-1][3]
  return Problem(
    prompt=f"Q: {draw.prompt}\nA:", completion=f" {work} Answer: {answer}", answer=answer
  )


def generate(split: str, index: int, seed: int) -> Problem:
  """Deterministic problem number `index` of `split` ("train" or "eval") for `seed`."""
  if split not in SPLITS:
    raise ValueError(f"unknown arithmetic split {split!r}; expected one of {SPLITS}")
  want_held_out = split == "eval"
  for attempt in range(10_000):
    r = _rng(seed, split, index, attempt)
    name, pron = r.choice(_NAMES)
    draw = r.choice(_TEMPLATES)(r, name, pron, r.choice(_OBJECTS))
    if is_held_out(_signature(draw)) == want_held_out:
      return _render(draw)
  raise RuntimeError("arithmetic generator failed to hit the requested split")  # unreachable


_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


def extract_answer(text: str) -> int | None:
  """The integer after the first "Answer:" in `text`, or None if there is none."""
  match = _ANSWER_RE.search(text)
  return int(match.group(1)) if match else None


def check_worked_solution(problem: Problem) -> bool:
  """True if every equation in the completion is correct and the last result is the answer."""
  equations = re.findall(r"(\d+)([-+*/])(\d+)=(-?\d+)\.", problem.completion)
  if not equations:
    return False
  ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}
  for lhs, op, rhs, res in equations:
    if op == "/" and int(lhs) % int(rhs):
      return False
    if ops[op](int(lhs), int(rhs)) != int(res):
      return False
  return int(equations[-1][3]) == problem.answer == extract_answer(problem.completion)
