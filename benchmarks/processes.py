"""Independent benchmark runs in parallel processes, each with its own JAX runtime.

A small model leaves an accelerator mostly idle (the tiny and paper_small configs on one GPU run
at a few percent of its FLOPs), so several trainings share it well; on a 2-core CPU they only
compete, so `jobs=1` (the default of every benchmark) runs in this process. Processes are
spawned, never forked (a forked JAX runtime is unsafe), and on a GPU they allocate memory as
they need it instead of each taking most of it (`XLA_PYTHON_CLIENT_PREALLOCATE=false` unless
already set).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from typing import Any, Callable, Iterator, Sequence


def starmap(
  fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], jobs: int = 1
) -> Iterator[Any]:
  """`fn(*args)` for every args in `calls`, results in the order of `calls`, with up to `jobs`
  processes (1: here, one after another). `fn` must be importable: a module-level function."""
  if jobs < 1:
    raise ValueError(f"jobs must be >= 1, got {jobs}")
  if jobs == 1:
    for args in calls:
      yield fn(*args)
    return
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # inherited by the children
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(min(jobs, len(calls) or 1), context) as pool:
    futures = [pool.submit(fn, *args) for args in calls]
    for future in futures:
      yield future.result()
