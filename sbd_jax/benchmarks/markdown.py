"""Markdown tables for benchmark reports."""

from __future__ import annotations

from typing import Sequence


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  """A GitHub-flavoured markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
