"""Markdown tables for benchmark reports, and the files a benchmark writes."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def save(
  out_dir: str,
  stem: str,
  results: dict[str, Any],
  report: str,
  plot: Callable[[str], None] | None = None,
) -> None:
  """`out_dir`/results.json, `out_dir`/<stem>.md and, given `plot` (which draws to a path),
  `out_dir`/<stem>.png."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
    f.write(report + "\n")
  if plot is not None:
    plot(os.path.join(out_dir, f"{stem}.png"))


def print_and_save(out_dir: str | None, stem: str, results: dict[str, Any], report: str) -> None:
  """Print `report`; with `out_dir`, also `save` it and `results` there."""
  print(report)
  if out_dir:
    save(out_dir, stem, results, report)
