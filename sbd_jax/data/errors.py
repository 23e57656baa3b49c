"""Training data that cannot be used as it is: the one-line error, and the count of records
skipped under `data.skip_bad_records`."""

import threading


class DataError(ValueError):
  """Training data that cannot be used as it is; the message names the file and line (or
  record) and fits on one line."""


class BadRecords:
  """Records skipped under `data.skip_bad_records`: how many, and the first few reasons."""

  def __init__(self, keep: int = 3):
    self.count, self.examples, self._keep = 0, [], keep
    self._lock = threading.Lock()  # lazy sources are read by several Grain threads

  def add(self, error: DataError) -> None:
    with self._lock:
      self.count += 1
      if len(self.examples) < self._keep:
        self.examples.append(str(error))

  def __getstate__(self) -> dict:  # to grain's worker processes, whose counts stay there
    return {k: v for k, v in self.__dict__.items() if k != "_lock"}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state, _lock=threading.Lock())


def decode_utf8(data: bytes, where: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{where}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start})") from None
