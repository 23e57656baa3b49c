"""The statistics every evaluation reports: Wilson intervals, paired differences, rows busy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Z95 = 1.959964


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
  """95 % Wilson score interval of a binomial proportion (well-behaved near 0 and 1)."""
  if n == 0:
    return (0.0, 1.0)
  p = successes / n
  center = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return (max(0.0, center - half), min(1.0, center + half))


def paired_difference(a: np.ndarray, b: np.ndarray, z: float = Z95) -> dict[str, Any]:
  """Mean of a - b over paired problems, with a normal-approximation 95 % interval."""
  d = a.astype(float) - b.astype(float)
  half = z * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else math.inf
  return {"mean": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)]}


def rows_busy(nfe: np.ndarray, row_forwards: np.ndarray) -> float:
  """Share of the decode loop's row-forwards that served a row still decoding: each problem's
  row ran `row_forwards` (its batch's forwards, or with refill those its row ran while holding
  it), of which it needed `nfe`. 1.0 = no idle row."""
  spent = int(np.sum(row_forwards))
  return float(np.sum(nfe) / spent) if spent else 1.0
