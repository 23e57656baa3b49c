"""The integers a JSON schema's `minimum` / `maximum` (and the exclusive ones) allow (`bounds`),
and a regex whose full matches are exactly the JSON integers in that range (`range_regex`):
outlines-core's regex for "integer" does not enforce the bounds.

JSON writes an integer without leading zeros and without a plus sign; `-0` is valid JSON but
never needed, so it is left out. A range splits into its negative part, written as a minus
and the range of magnitudes, and its non-negative part. A range of magnitudes [a, b] splits at
each power of ten into ranges of one digit count, and each of those digit by digit: numbers of
n digits between two n-digit strings are the ones that share their first digits and then differ
by a digit range ("1[3-9]" ... ), the classic construction.
"""

from __future__ import annotations

import math
from typing import Any

# An integer's bounds in a JSON schema (draft 6 on: the exclusive ones are numbers).
INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_BOUND = 2**63 - 1  # 64-bit integers


def bounds(keywords: dict[str, Any]) -> tuple[int | None, int | None]:
  """The least and greatest integer that a schema's `INTEGER_BOUNDS` keywords allow (None:
  unbounded); ValueError (naming the keyword) where a bound is not a number within 64 bits."""
  lows, highs = [], []
  for key, value in keywords.items():
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise ValueError(f"{key} must be a number")
    if abs(value) > MAX_BOUND:
      raise ValueError(f"{key} {value} is outside the 64-bit range")
    if key == "minimum":
      lows.append(math.ceil(value))
    elif key == "exclusiveMinimum":
      lows.append(math.floor(value) + 1)
    elif key == "maximum":
      highs.append(math.floor(value))
    else:
      highs.append(math.ceil(value) - 1)
  return max(lows, default=None), min(highs, default=None)


def range_regex(low: int | None, high: int | None) -> str:
  """A regex (outlines-core's syntax, a non-capturing group) matching the decimal JSON integers
  n with low <= n <= high (None: unbounded on that side). ValueError where no integer is in
  the range."""
  if low is not None and high is not None and low > high:
    raise ValueError(f"no integer is >= {low} and <= {high}")
  parts = []
  if low is None or low < 0:  # magnitudes of the negative numbers: [max(1, -high), -low]
    top = None if low is None else -low
    bottom = 1 if high is None or high >= 0 else -high
    parts += [f"-{p}" for p in _magnitudes(bottom, top)]
  if high is None or high >= 0:
    parts += _magnitudes(max(low or 0, 0), high)
  return "(?:" + "|".join(parts) + ")"


def _magnitudes(a: int, b: int | None) -> list[str]:
  """Alternatives matching the decimals of a..b (b None: unbounded), 0 <= a."""
  parts = []
  digits = len(str(a))
  while b is None or digits <= len(str(b)):
    top = 10**digits - 1 if b is None or digits < len(str(b)) else b
    parts += _same_length(str(a), str(top))
    a, digits = 10**digits, digits + 1
    if b is None:  # every longer number: a leading non-zero digit and `digits - 1` more
      parts.append(f"[1-9][0-9]{{{digits - 1},}}")
      break
  return parts


def _same_length(a: str, b: str) -> list[str]:
  """Alternatives for the digit strings of one length from a to b (a <= b as numbers). Used on
  whole numbers (no leading zero unless "0") and on their tails (any digits)."""
  if not a:
    return [""]
  if a[0] == b[0]:
    return [a[0] + rest for rest in _same_length(a[1:], b[1:])]
  n = len(a) - 1
  tail = "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"
  if a[1:] == "0" * n and b[1:] == "9" * n:  # every tail: one digit range
    return [_digits(a[0], b[0]) + tail]
  parts = [a[0] + rest for rest in _same_length(a[1:], "9" * n)]
  if int(a[0]) + 1 <= int(b[0]) - 1:
    parts.append(_digits(str(int(a[0]) + 1), str(int(b[0]) - 1)) + tail)
  parts += [b[0] + rest for rest in _same_length("0" * n, b[1:])]
  return parts


def _digits(low: str, high: str) -> str:
  return low if low == high else f"[{low}-{high}]"
