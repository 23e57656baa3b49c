"""Reading benchmark files: JSONL, plain or gzipped, with errors that name the file and line."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any


class TaskDataError(ValueError):
  """A benchmark or completions file that cannot be used (one-line message with file:line)."""


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      yield from enumerate(f, start=1)
  except gzip.BadGzipFile:
    raise TaskDataError(f"{path}: not a gzip file (the name ends in .gz)") from None


def read_jsonl(path: str, required: Sequence[str] = ()) -> list[dict[str, Any]]:
  """Every object of a JSONL file (`.gz` read as gzip); blank lines are skipped. A line that is
  not a JSON object, or lacks one of `required`, raises TaskDataError naming file and line."""
  if not os.path.isfile(path):
    raise TaskDataError(f"{path}: no such file")
  records = []
  for line_no, raw in _lines(path):
    where = f"{path}:{line_no}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError:
      raise TaskDataError(f"{where}: not UTF-8 text (is this a JSONL file?)") from None
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise TaskDataError(f"{where}: not JSON ({e.msg}); expected one object per line") from None
    if not isinstance(obj, dict):
      raise TaskDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [field for field in required if field not in obj]
    if missing:
      raise TaskDataError(f"{where}: missing field(s) {missing}; the line has {sorted(obj)}")
    records.append(obj)
  if not records:
    raise TaskDataError(f"{path}: no records")
  return records


def append_jsonl(path: str, records: Sequence[dict[str, Any]]) -> None:
  """Appends records and flushes them to disk, so an interrupted run keeps what it finished."""
  with open(path, "a", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


def read_finished(path: str, repair: bool = False) -> list[dict[str, Any]]:
  """The records of an earlier, possibly interrupted, run. A torn last line (the one being
  written when the run stopped) is dropped, and with `repair` cut from the file, so that
  appending continues on a clean line."""
  if not os.path.isfile(path):
    return []
  records, good_bytes = [], 0
  with open(path, "rb") as f:
    for raw in f:
      try:
        records.append(json.loads(raw))
      except (json.JSONDecodeError, UnicodeDecodeError):
        break
      if not raw.endswith(b"\n"):
        records.pop()  # complete JSON but no newline: rewrite it whole
        break
      good_bytes += len(raw)
  if repair and good_bytes != os.path.getsize(path):
    with open(path, "r+b") as f:
      f.truncate(good_bytes)
  return records
