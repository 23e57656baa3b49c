"""Final-answer extraction and normalisation for math tasks (GSM8K numbers, MATH `\\boxed{}`).

GSM8K: the reference is the number after `####`; a completion's answer is the number after its
last "The answer is" or "####", else in its last `\\boxed{}`, else its last number. Numbers
compare by value after removing thousands separators, currency and trailing punctuation
("1,000.00" == "1000").

MATH: a completion's answer is the content of its last `\\boxed{...}` (or `\\fbox{...}`), braces
balanced. Both sides are normalised the way the common MATH harnesses do (the rules are listed
in `normalize_math`) and compared as strings.
"""

from __future__ import annotations

import re

_NUMBER_RE = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_STATED_RE = re.compile(
  r"(?:The answer is|####)\s*:?\s*(-?[$]?\s*\d[\d,]*(?:\.\d+)?)", re.IGNORECASE
)


def parse_number(text: str) -> float | None:
  """ "$1,234.50" -> 1234.5; None when `text` is not a number."""
  cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
  try:
    return float(cleaned)
  except ValueError:
    return None


def gsm8k_reference(answer_field: str) -> str:
  """The final answer of a GSM8K `answer` field: the text after its `####`."""
  if "####" not in answer_field:
    raise ValueError("GSM8K answer has no '#### <number>' line")
  return answer_field.rsplit("####", 1)[1].strip()


def extract_number(completion: str) -> str | None:
  """The completion's final answer as written: after its last "The answer is" / "####", else
  in its last `\\boxed{}`, else its last number; None if it states no number."""
  stated = _STATED_RE.findall(completion)
  if stated:
    return stated[-1].strip()
  boxed = last_boxed(completion)
  if boxed is not None:
    return extract_number(boxed)
  numbers = _NUMBER_RE.findall(completion)
  return numbers[-1] if numbers else None


def numbers_equal(predicted: str | None, reference: str) -> bool:
  if predicted is None:
    return False
  a, b = parse_number(predicted), parse_number(reference)
  return a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(b))


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces kept), or of a
  `\\boxed 5`-style argument; None if there is none or its braces never close."""
  boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
  if max(boxed, fbox) < 0:
    return None
  rest = text[boxed + len("\\boxed") :] if boxed > fbox else text[fbox + len("\\fbox") :]
  if rest.startswith(" "):
    return rest[1:].split("$")[0].strip() or None
  if not rest.startswith("{"):
    return None
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch == "{"
    depth -= ch == "}"
    if depth == 0:
      return rest[1:i]
  return None


_UNIT_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{\s*[a-zA-Z ]*\}\s*$")


def _take_argument(s: str, i: int) -> tuple[str, int]:
  """The TeX argument starting at s[i] (a braced group, or one character which gets braces)
  and the index after it."""
  if i >= len(s):
    return "", i
  if s[i] != "{":
    return "{" + s[i] + "}", i + 1
  depth = 0
  for j in range(i, len(s)):
    depth += (s[j] == "{") - (s[j] == "}")
    if depth == 0:
      return s[i : j + 1], j + 1
  return s[i:], len(s)


def _braced_fracs(s: str) -> str:
  """\\frac12 -> \\frac{1}{2}, \\frac1{22} -> \\frac{1}{22}, \\frac{1}2 -> \\frac{1}{2}."""
  pieces, done = [], 0
  while (start := s.find("\\frac", done)) >= 0:
    numerator, after = _take_argument(s, start + len("\\frac"))
    denominator, after = _take_argument(s, after)
    pieces += [s[done:start], "\\frac", numerator, denominator]
    done = after
  return "".join(pieces) + s[done:]


def _braced_sqrt(s: str) -> str:
  """\\sqrt3 -> \\sqrt{3}."""
  return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def _slash_fraction(s: str) -> str:
  """ "3/4" -> \\frac{3}{4} when both sides are integers."""
  match = re.fullmatch(r"(-?\d+)/(\d+)", s)
  return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else s


def _trim_decimal(s: str) -> str:
  """ "2.50" -> "2.5", "3.0" -> "3", ".5" -> "0.5", "1,000" -> "1000" (plain numbers only)."""
  if re.fullmatch(r"-?[\d,]*\.?\d*", s) and any(c.isdigit() for c in s):
    s = s.replace(",", "")
    if s.startswith("."):
      s = "0" + s
    if s.startswith("-."):
      s = "-0" + s[1:]
    if "." in s:
      s = s.rstrip("0").rstrip(".")
  return s


def normalize_math(answer: str) -> str:
  """Canonical form of a MATH answer: no spaces, line breaks, `\\left`/`\\right`, `\\!`,
  dollar signs, degree marks, percent signs or a trailing unit in `\\text{}`; `tfrac`/`dfrac`
  as `frac`, fractions and square roots braced, "a/b" as a fraction, a lone "x =" dropped,
  "0.5" as `\\frac{1}{2}`, trailing decimal zeros removed."""
  s = answer.strip().replace("\n", "").replace("\\!", "")
  s = s.replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
  s = s.replace("\\left", "").replace("\\right", "")
  s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
  s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
  s = _UNIT_TEXT_RE.sub("", s).strip()
  s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
  if re.fullmatch(r"[a-zA-Z]\s*=.*", s) and s.count("=") == 1:
    s = s.split("=", 1)[1]
  s = s.replace(" ", "").rstrip(".")
  s = _braced_sqrt(_braced_fracs(s))
  if s == "0.5":
    s = "\\frac{1}{2}"
  return _slash_fraction(_trim_decimal(s))


def math_equal(predicted: str | None, reference: str) -> bool:
  return predicted is not None and normalize_math(predicted) == normalize_math(reference)
