"""Parquet shards (as the Hugging Face Hub ships datasets), local or in a bucket, as a Grain
random-access source: an index of every file's row groups is read from the files' footers, and
a record is read from its row group alone (the last one read is kept per thread, as Arrow
columns; only the record's row becomes Python objects), never the whole file. Parquet's unit of
reading is the row group, so shuffled reads of a large corpus read about one group per record:
shards written with small row groups, or converted to ArrayRecord, read less. Rows are parsed
with the run's field map (`data.fields`)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

import grain
from etils import epath

from sbd_jax.data.errors import DataError
from sbd_jax.data.fields import FieldMap, Record, parse_record


def _open(path: str):
  import pyarrow.parquet as pq  # heavy import

  try:
    return pq.ParquetFile(epath.Path(path).open("rb"))
  except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
    raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


class ParquetSource(grain.sources.RandomAccessDataSource):
  """The rows of `files`, in file order, as records."""

  def __init__(self, files: Sequence[str], fields: FieldMap):
    self._files, self._fields = list(files), fields
    self._groups: list[tuple[int, int]] = []  # (file, row group), in order
    self._starts: list[int] = []  # the first global row of each group
    self._file_starts: list[int] = []  # ... and of each file
    total = 0
    for i, path in enumerate(self._files):
      self._file_starts.append(total)
      meta = _open(path).metadata
      for g in range(meta.num_row_groups):
        self._groups.append((i, g))
        self._starts.append(total)
        total += meta.row_group(g).num_rows
    self._length = total
    self._local = threading.local()  # per thread: open files and the last group read

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> Record:
    index = int(index)
    if not 0 <= index < self._length:
      raise IndexError(f"row {index} of {self._length}")
    k = bisect.bisect_right(self._starts, index) - 1
    file, group = self._groups[k]
    table = self._row_group(file, group)
    (row,) = table.slice(index - self._starts[k], 1).to_pylist()  # one row to Python, not all
    where = f"{self._files[file]} row {index - self._file_starts[file]}"
    return parse_record(row, self._fields, where)

  def _row_group(self, file: int, group: int):
    """The row group as an Arrow table (columnar, read once per group and thread)."""
    local = self._local
    if getattr(local, "key", None) != (file, group):
      handles = local.__dict__.setdefault("files", {})
      if file not in handles:
        handles[file] = _open(self._files[file])
      local.table, local.key = handles[file].read_row_group(group), (file, group)
    return local.table

  def __repr__(self) -> str:
    return f"ParquetSource({len(self._files)} files, {self._length} rows)"

  def __getstate__(self) -> dict:  # to grain's worker processes: no open files, no cache
    return {k: v for k, v in self.__dict__.items() if k != "_local"}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state, _local=threading.local())
