"""Random-access sources of raw documents, selected by `data_cfg.source`.

Every source yields records `{"text": str}`, `{"prompt": str, "completion": str}` or
`{"messages": [{"role": str, "content": str}, ...]}` (a conversation, rendered with the
tokenizer's chat template), read through the run's field map (`fields`); tokenizing and packing
happen downstream in `pipeline.py`.
"""

import glob
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import ml_collections
from etils import epath

from sbd_jax.data import arithmetic
from sbd_jax.data.errors import BadRecords, DataError, decode_utf8
from sbd_jax.data.fields import FieldMap, Record, parse_record
from sbd_jax.data.parquet import ParquetSource
from sbd_jax.paths import is_remote

SOURCES = ("arithmetic", "jsonl", "text", "array_record", "parquet", "tfds")


def expand_paths(paths: str) -> list[str]:
  """Comma-separated globs, local or in a bucket (gs://bucket/dir/*.array_record) -> sorted
  unique file paths; DataError if nothing matches."""
  patterns = [p.strip() for p in (paths or "").split(",") if p.strip()]
  files = sorted({f for p in patterns for f in _glob(p)})
  if not files:
    raise DataError(f"no files match data.paths={paths!r}")
  return files


def _glob(pattern: str) -> list[str]:
  if not is_remote(pattern):
    return [f for f in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(f)]
  parts = pattern.split("/")  # the folder before the first wildcard is listed through epath
  first = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
  root = epath.Path("/".join(parts[:first]))
  found = root.glob("/".join(parts[first:])) if first < len(parts) else [root]
  return [str(f) for f in found if f.is_file()]


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
    path = self._files[index]
    with epath.Path(path).open("rb") as f:
      return {"text": decode_utf8(f.read(), path)}


class SkippingSource(grain.sources.RandomAccessDataSource):
  """Another source whose unusable records (DataError) read as None, which Grain drops; each is
  counted in `bad`. For sources read lazily (text files, ArrayRecord, TFDS)."""

  def __init__(self, inner: Any, bad: BadRecords):
    self._inner, self._bad = inner, bad

  def __len__(self) -> int:
    return len(self._inner)

  def __getitem__(self, index: int) -> Record | None:
    try:
      return self._inner[index]
    except DataError as e:
      self._bad.add(e)
      return None

  def __repr__(self) -> str:
    return f"SkippingSource({self._inner!r})"


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


def iter_jsonl(
  files: Sequence[str], fields: FieldMap | str, bad: BadRecords | None = None
) -> Iterator[tuple[int, bytes, Record]]:
  """(index, line, record) for each non-blank line of `files`, streamed: index counts the
  non-blank lines from 1, and a line that is not a usable record raises DataError naming file
  and line, or, given `bad`, is skipped and counted there."""
  index = 0
  for path in files:
    with epath.Path(path).open("rb") as f:
      for line_no, raw in enumerate(f, start=1):
        where = f"{path}:{line_no}"
        try:
          line = decode_utf8(raw, where)
          if not line.strip():
            continue
          index += 1
          try:
            obj = json.loads(line)
          except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})") from None
          yield index, raw.strip(), parse_record(obj, fields, where)
        except DataError as e:
          if bad is None:
            raise
          bad.add(e)


def read_jsonl(
  files: Sequence[str], fields: FieldMap | str, bad: BadRecords | None = None
) -> list[Record]:
  """Parses every line now, so that a bad line fails at once with its file and line number
  (DataError), or, given `bad`, is skipped and counted there."""
  records = [record for _, _, record in iter_jsonl(files, fields, bad)]
  if not records:
    raise DataError(f"no usable records in data.paths ({len(files)} files)")
  return records


def _array_record_source(files: Sequence[str], fields: FieldMap) -> ParsedSource:
  def parse(raw: bytes, index: int) -> Record:
    where = f"array_record record {index}"
    try:
      obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise DataError(f"{where}: record is not JSON bytes ({e})") from None
    return parse_record(obj, fields, where)

  return ParsedSource(grain.sources.ArrayRecordDataSource(list(files)), parse, "array_record")


def _tfds_source(cfg: ml_collections.ConfigDict) -> ParsedSource:
  """Reads a locally prepared TFDS dataset (ArrayRecord format) without TensorFlow.

  Never downloads or prepares: an unprepared dataset raises DataError naming name/split/dir.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow import)

  if not cfg.tfds_name:
    raise DataError("data.source='tfds' needs data.tfds_name")
  try:
    inner = tfds.data_source(
      cfg.tfds_name, split=cfg.tfds_split, data_dir=cfg.tfds_data_dir or None, download=False
    )
  except Exception as e:  # TFDS raises several types (DatasetNotFoundError, AssertionError, ...)
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise DataError(
      f"TFDS dataset {cfg.tfds_name!r} split {cfg.tfds_split!r} is not prepared in "
      f"data_dir={cfg.tfds_data_dir!r} ({type(e).__name__}: {first_line})"
    ) from None
  where = f"tfds {cfg.tfds_name}/{cfg.tfds_split}"
  return ParsedSource(
    inner, lambda ex, i: parse_record(ex, FieldMap.of(cfg), f"{where} example {i}"), where
  )


def make_source(
  cfg: ml_collections.ConfigDict,
  seed: int,
  bad: BadRecords | None = None,
  arithmetic_split: str = "train",
) -> grain.sources.RandomAccessDataSource:
  """The source for `cfg.source` (fields documented in `default_data_config`). With `bad`
  given, unusable records are skipped and counted there instead of raising DataError. The
  built-in task draws its problems from `arithmetic_split` ("eval": the held-out problems)."""
  if cfg.source == "arithmetic":
    difficulty = arithmetic.Difficulty.of(cfg.arithmetic)
    return ArithmeticSource(
      arithmetic_split,
      seed,
      cfg.arithmetic.num_train,
      difficulty,
      cfg.arithmetic.drill_fraction if arithmetic_split == "train" else 0.0,  # eval: problems
    )
  fields = FieldMap.of(cfg)
  if cfg.source == "jsonl":
    return ListSource(read_jsonl(expand_paths(cfg.paths), fields, bad))
  if cfg.source == "text":
    source = TextFileSource(expand_paths(cfg.paths))
  elif cfg.source == "array_record":
    source = _array_record_source(expand_paths(cfg.paths), fields)
  elif cfg.source == "parquet":
    source = ParquetSource(expand_paths(cfg.paths), fields)
  elif cfg.source == "tfds":
    source = _tfds_source(cfg)
  else:
    raise DataError(f"unknown data.source {cfg.source!r}; expected one of {SOURCES}")
  return source if bad is None else SkippingSource(source, bad)
