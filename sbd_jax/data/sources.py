"""Random-access sources of raw documents, selected by `data_cfg.source`.

Every source yields records `{"text": str}` or `{"prompt": str, "completion": str}`; tokenizing
and packing happen downstream in `pipeline.py`.
"""

import glob
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import ml_collections

from sbd_jax.data import arithmetic

Record = dict[str, str]
SOURCES = ("arithmetic", "jsonl", "text", "array_record", "tfds")


def parse_record(obj: Any, text_field: str, where: str) -> Record:
  """Normalizes a JSON object / TFDS example to a record; `where` names it in errors."""
  if not isinstance(obj, Mapping):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")

  def as_str(key: str) -> str:
    value = obj[key]
    if isinstance(value, bytes):
      return value.decode("utf-8")
    if not isinstance(value, str):
      raise ValueError(f"{where}: field {key!r} is {type(value).__name__}, expected a string")
    return value

  if text_field in obj:
    return {"text": as_str(text_field)}
  if "prompt" in obj and "completion" in obj:
    return {"prompt": as_str("prompt"), "completion": as_str("completion")}
  raise ValueError(f"{where}: missing field {text_field!r} (or 'prompt' + 'completion')")


def expand_paths(paths: str) -> list[str]:
  """Comma-separated globs -> sorted unique file paths; ValueError if nothing matches."""
  patterns = [p.strip() for p in (paths or "").split(",") if p.strip()]
  files = sorted(
    {f for p in patterns for f in glob.glob(os.path.expanduser(p)) if os.path.isfile(f)}
  )
  if not files:
    raise ValueError(f"no files match data.paths={paths!r}")
  return files


class ArithmeticSource(grain.sources.RandomAccessDataSource):
  """Problems `generate(split, i, seed)` for i in [0, length) as prompt/completion records;
  a `drill_fraction` share of the indices are equation drills (`arithmetic.drill`) instead."""

  def __init__(
    self,
    split: str,
    seed: int,
    length: int,
    difficulty: arithmetic.Difficulty = arithmetic.DEFAULT_DIFFICULTY,
    drill_fraction: float = 0.0,
  ):
    self._split, self._seed, self._length, self._difficulty = split, seed, length, difficulty
    self._drill_fraction = drill_fraction

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> Record:
    index = int(index)
    if self._drill_fraction and (index * 0.6180339887) % 1.0 < self._drill_fraction:
      return {"text": arithmetic.drill(index, self._seed, self._difficulty)}
    p = arithmetic.generate(self._split, index, self._seed, self._difficulty)
    return {"prompt": p.prompt, "completion": p.completion}

  def __repr__(self) -> str:
    return f"ArithmeticSource(split={self._split!r}, seed={self._seed}, length={self._length})"


class ListSource(grain.sources.RandomAccessDataSource):
  """In-memory records (e.g. parsed JSONL)."""

  def __init__(self, records: Sequence[Record]):
    self._records = list(records)

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> Record:
    return self._records[index]


class TextFileSource(grain.sources.RandomAccessDataSource):
  """One document per file; files are read lazily."""

  def __init__(self, files: Sequence[str]):
    self._files = list(files)

  def __len__(self) -> int:
    return len(self._files)

  def __getitem__(self, index: int) -> Record:
    with open(self._files[index], encoding="utf-8") as f:
      return {"text": f.read()}


class ParsedSource(grain.sources.RandomAccessDataSource):
  """Applies `parse(raw, index)` to each element of another random-access source."""

  def __init__(self, inner: Any, parse: Callable[[Any, int], Record], name: str):
    self._inner, self._parse, self._name = inner, parse, name

  def __len__(self) -> int:
    return len(self._inner)

  def __getitem__(self, index: int) -> Record:
    return self._parse(self._inner[index], int(index))

  def __repr__(self) -> str:
    return f"ParsedSource({self._name})"


def read_jsonl(files: Sequence[str], text_field: str) -> list[Record]:
  """Parses every line now so that a bad line fails with its file and line number."""
  records = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      for line_no, line in enumerate(f, start=1):
        if not line.strip():
          continue
        where = f"{path}:{line_no}"
        try:
          obj = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
        records.append(parse_record(obj, text_field, where))
  return records


def _array_record_source(files: Sequence[str], text_field: str) -> ParsedSource:
  def parse(raw: bytes, index: int) -> Record:
    where = f"array_record record {index}"
    try:
      obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{where}: record is not JSON bytes ({e})") from None
    return parse_record(obj, text_field, where)

  return ParsedSource(grain.sources.ArrayRecordDataSource(list(files)), parse, "array_record")


def _tfds_source(cfg: ml_collections.ConfigDict) -> ParsedSource:
  """Reads a locally prepared TFDS dataset (ArrayRecord format) without TensorFlow.

  Never downloads or prepares: an unprepared dataset raises ValueError naming name/split/dir.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow import)

  if not cfg.tfds_name:
    raise ValueError("data.source='tfds' needs data.tfds_name")
  try:
    inner = tfds.data_source(
      cfg.tfds_name, split=cfg.tfds_split, data_dir=cfg.tfds_data_dir or None, download=False
    )
  except Exception as e:  # TFDS raises several types (DatasetNotFoundError, AssertionError, ...)
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ValueError(
      f"TFDS dataset {cfg.tfds_name!r} split {cfg.tfds_split!r} is not prepared in "
      f"data_dir={cfg.tfds_data_dir!r} ({type(e).__name__}: {first_line})"
    ) from None
  where = f"tfds {cfg.tfds_name}/{cfg.tfds_split}"
  return ParsedSource(
    inner, lambda ex, i: parse_record(ex, cfg.text_field, f"{where} example {i}"), where
  )


def make_source(cfg: ml_collections.ConfigDict, seed: int) -> grain.sources.RandomAccessDataSource:
  """The training source for `cfg.source` (fields documented in `default_data_config`)."""
  if cfg.source == "arithmetic":
    difficulty = arithmetic.Difficulty.of(cfg.arithmetic)
    return ArithmeticSource(
      "train", seed, cfg.arithmetic.num_train, difficulty, cfg.arithmetic.drill_fraction
    )
  if cfg.source == "jsonl":
    return ListSource(read_jsonl(expand_paths(cfg.paths), cfg.text_field))
  if cfg.source == "text":
    return TextFileSource(expand_paths(cfg.paths))
  if cfg.source == "array_record":
    return _array_record_source(expand_paths(cfg.paths), cfg.text_field)
  if cfg.source == "tfds":
    return _tfds_source(cfg)
  raise ValueError(f"unknown data.source {cfg.source!r}; expected one of {SOURCES}")
