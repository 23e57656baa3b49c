"""Compiling constraints off the caller: bounded in time, states, bytes and memory; cached.

`ConstraintCompiler.compile` sends the constraint to a worker process (`worker`) and waits at
most `timeout_s`; past it the worker is killed (and restarted for the next constraint), and the
constraint is refused in one line. `submit` does the same on the compiler's own thread and
returns a future, for callers (an event loop) that must not wait; `lookup` reads the cache
alone. The worker starts, and receives each new vocabulary, outside the constraint's time.

Results are cached by (constraint, vocabulary fingerprint), least recently used first out,
within `cache_entries` and `cache_bytes` of tables; refusals are cached too, so a hostile
constraint sent again is refused at once. Compiles run one at a time.

Why outlines-core: it is what vLLM, SGLang and TGI compile regexes and JSON schemas with
(Apache-2.0, wheels for Linux, macOS and Windows, no dependencies), and its output is a finite
token automaton, the form that fits fixed device tables. xgrammar compiles context-free
grammars to a pushdown automaton whose stack does not fit fixed per-state tables.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
import time

import sbd_jax
from sbd_jax.constrain.automaton import Limits, TokenAutomaton
from sbd_jax.constrain.spec import Constraint, ConstraintError, one_line
from sbd_jax.constrain.vocabulary import TokenVocabulary
from sbd_jax.constrain.worker import HEADER_BYTES, write_message


@dataclasses.dataclass(frozen=True)
class CompilerSettings:
  """Bounds of one compile and of the cache."""

  timeout_s: float = 30.0  # one constraint's compile, in the worker
  max_states: int = 8192  # per automaton
  max_table_bytes: int = 256 << 20  # per automaton (a 128k vocabulary: 16 KiB a state)
  worker_memory_bytes: int = 8 << 30  # the worker's address space (0: no limit)
  startup_timeout_s: float = 120.0  # starting the worker, or sending it a vocabulary
  cache_entries: int = 256
  cache_bytes: int = 2 << 30

  def limits(self) -> Limits:
    return Limits(max_states=self.max_states, max_table_bytes=self.max_table_bytes)


class _WorkerGone(Exception):
  """The worker did not answer in time, or died."""


class _Worker:
  """One worker process."""

  def __init__(self, memory_bytes: int, startup_timeout_s: float):
    """Starts the worker and waits for it; RuntimeError if it does not answer in time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(sbd_jax.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    self.errors = tempfile.TemporaryFile()  # the worker's stderr: its last words, if it dies
    self.process = subprocess.Popen(
      [sys.executable, "-m", "sbd_jax.constrain.worker", str(memory_bytes)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.errors,
      env=env,
    )
    try:
      self.read(startup_timeout_s)
    except _WorkerGone as e:
      self.kill()
      raise RuntimeError(one_line(f"the constraint compiler's worker did not start: {e}")) from None

  def read(self, timeout_s: float):
    """The next reply within `timeout_s`, else _WorkerGone."""
    deadline = time.monotonic() + timeout_s
    data, need = bytearray(), HEADER_BYTES
    fd = self.process.stdout.fileno()
    while len(data) < need:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise _WorkerGone("timeout")
      chunk = os.read(fd, max(need - len(data), 1 << 16))
      if not chunk:
        raise _WorkerGone(f"exit {self.process.wait()}: {self.last_words()}")
      data += chunk
      if need == HEADER_BYTES and len(data) >= HEADER_BYTES:
        need += int.from_bytes(data[:HEADER_BYTES], "little")
    return pickle.loads(bytes(data[HEADER_BYTES:need]))

  def request(self, message: tuple, timeout_s: float):
    try:
      write_message(self.process.stdin, message)
    except (BrokenPipeError, OSError) as e:
      raise _WorkerGone(f"exit {self.process.wait()}: {self.last_words()}") from e
    return self.read(timeout_s)

  def last_words(self) -> str:
    """The last line the worker wrote to stderr."""
    self.errors.seek(0)
    lines = self.errors.read().decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "no message"

  def kill(self) -> None:
    self.process.kill()
    self.process.wait()
    for stream in (self.process.stdin, self.process.stdout, self.errors):
      stream.close()


class ConstraintCompiler:
  """Compiles constraints to `TokenAutomaton`s in a worker process; see the module docstring.
  Thread-safe. Close it (or use it as a context manager) to end the worker."""

  def __init__(self, settings: CompilerSettings = CompilerSettings()):
    self.settings = settings
    self._worker: _Worker | None = None
    self._worker_lock = threading.Lock()
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._cache_lock = threading.Lock()
    self._cache_bytes = 0
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "constraint-compiler")
    self.hits = self.misses = 0

  def __enter__(self) -> ConstraintCompiler:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    self._executor.shutdown(wait=True)
    with self._worker_lock:
      if self._worker is not None:
        self._worker.kill()
        self._worker = None

  def submit(
    self, constraint: Constraint, vocabulary: TokenVocabulary
  ) -> concurrent.futures.Future:
    """`compile` on the compiler's thread: a future of the automaton (or ConstraintError)."""
    return self._executor.submit(self.compile, constraint, vocabulary)

  def lookup(self, constraint: Constraint, vocabulary: TokenVocabulary) -> TokenAutomaton | None:
    """The cached automaton of `constraint` (its cached refusal raised), or None: a caller on
    an event loop answers a cached constraint without waiting behind another's compile."""
    found = self._cached((constraint, vocabulary.fingerprint))
    if isinstance(found, ConstraintError):
      raise ConstraintError(str(found))
    return found

  def compile(self, constraint: Constraint, vocabulary: TokenVocabulary) -> TokenAutomaton:
    """The automaton of `constraint` over `vocabulary`, from the cache or the worker; a
    ConstraintError (one line) where it is invalid, unsupported or too large."""
    key = (constraint, vocabulary.fingerprint)
    found = self._cached(key)
    if found is None:
      with self._worker_lock:
        found = self._cached(key)
        if found is None:
          self.misses += 1
          found = self._run(constraint, vocabulary)
          self._store(key, found)
    if isinstance(found, ConstraintError):
      raise ConstraintError(str(found))
    return found

  def _cached(self, key):
    with self._cache_lock:
      found = self._cache.get(key)
      if found is not None:
        self._cache.move_to_end(key)
        self.hits += 1
      return found

  def _store(self, key, value) -> None:
    size = value.table_bytes if isinstance(value, TokenAutomaton) else 0
    with self._cache_lock:
      self._cache[key] = value
      self._cache_bytes += size
      while len(self._cache) > self.settings.cache_entries or (
        self._cache_bytes > self.settings.cache_bytes and len(self._cache) > 1
      ):
        _, old = self._cache.popitem(last=False)
        self._cache_bytes -= old.table_bytes if isinstance(old, TokenAutomaton) else 0

  def _run(self, constraint: Constraint, vocabulary: TokenVocabulary):
    """The worker's automaton, or the ConstraintError that refuses the constraint. A worker
    that does not start, or cannot take the vocabulary, is a RuntimeError (not cached)."""
    s = self.settings
    message = ("compile", constraint, vocabulary.fingerprint, s.limits())
    try:
      if self._worker is None:
        self._worker = _Worker(s.worker_memory_bytes, s.startup_timeout_s)
      status, value = self._worker.request(message, s.timeout_s)
      if status == "missing":  # the worker does not hold this vocabulary (yet, or any more)
        self._setup(("vocabulary", vocabulary))
        status, value = self._worker.request(message, s.timeout_s)
    except _WorkerGone as e:
      self._drop_worker()
      if str(e) == "timeout":
        return ConstraintError(f"the constraint is too large: not compiled within {s.timeout_s} s")
      return ConstraintError(
        one_line(
          f"the constraint is too large: its compiler died ({e}; memory limit "
          f"{s.worker_memory_bytes} bytes)"
        )
      )
    return value if status == "ok" else ConstraintError(value)

  def _setup(self, message: tuple) -> None:
    """Sends the worker a vocabulary; RuntimeError if it does not take it in time."""
    try:
      self._worker.request(message, self.settings.startup_timeout_s)
    except _WorkerGone as e:
      self._drop_worker()
      raise RuntimeError(one_line(f"the constraint compiler's worker failed: {e}")) from None

  def _drop_worker(self) -> None:
    if self._worker is not None:
      self._worker.kill()
      self._worker = None
