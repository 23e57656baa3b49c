"""Stopping a run early and cleanly: SIGTERM (what a TPU VM maintenance event or a spot
preemption sends) and a wall-clock budget (`train.max_hours`).

Every process must stop at the same step, so the decision is shared: with several processes the
local flags are combined across hosts (a max over a tiny all-gather) every `sync_every` steps;
with one process the local flag is used at every step.
"""

from __future__ import annotations

import signal
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils


class StopRequest:
  """Watches for SIGTERM and the time budget; `should_stop(step)` is the same on every host."""

  def __init__(self, max_hours: float = 0.0, sync_every: int = 10):
    self.deadline = time.monotonic() + 3600 * max_hours if max_hours > 0 else None
    self.sync_every = sync_every
    self.reason: str | None = None
    self._signalled = False
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._signalled = True

  def _local(self) -> str | None:
    if self._signalled:
      return "SIGTERM"
    if self.deadline is not None and time.monotonic() >= self.deadline:
      return "train.max_hours reached"
    return None

  def should_stop(self, step: int) -> bool:
    """True when this run should save and stop after `step` (decided alike on every host)."""
    local = self._local()
    if jax.process_count() == 1:
      self.reason = local
      return local is not None
    if step % self.sync_every:
      return False
    flags = multihost_utils.process_allgather(np.int32(local is not None))
    if np.max(flags):
      self.reason = local or "another process was asked to stop"
      return True
    return False

  def close(self) -> None:
    """Restore the previous SIGTERM handler."""
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
