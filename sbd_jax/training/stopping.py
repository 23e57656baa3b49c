"""Stopping a run early and cleanly: SIGTERM (what a TPU VM maintenance event or a spot
preemption sends) and a wall-clock budget (`train.max_hours`).

Every process must stop at the same step. With several processes, a preemption notice is JAX's
own business: the distributed runtime's preemption service catches SIGTERM on any host, agrees
on a step with every other host, and `multihost_utils.reached_preemption_sync_point` says when
it is reached (asked at every step). The wall-clock budget is agreed by a max over a tiny
all-gather every `sync_every` steps. With one process both are local flags, checked every step.
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
    # Several processes: JAX's preemption service owns SIGTERM (a Python handler would hide the
    # signal from it). One process: a handler sets a flag.
    self._jax_preemption = jax.process_count() > 1 and jax.config.jax_enable_preemption_service
    if not self._jax_preemption and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._signalled = True

  def _out_of_time(self) -> bool:
    return self.deadline is not None and time.monotonic() >= self.deadline

  def should_stop(self, step: int) -> bool:
    """True when this run should save and stop after `step` (decided alike on every host).
    Called once per step, with increasing steps."""
    if jax.process_count() == 1:
      self.reason = "SIGTERM" if self._signalled else None
      if self.reason is None and self._out_of_time():
        self.reason = "train.max_hours reached"
      return self.reason is not None
    if self._jax_preemption and multihost_utils.reached_preemption_sync_point(step):
      self.reason = "preemption notice (SIGTERM) agreed by all processes"
      return True
    if step % self.sync_every or (self.deadline is None and self._jax_preemption):
      return False
    # SIGTERM seen here only when the preemption service is off (jax_enable_preemption_service).
    local = 2 if self._signalled else int(self._out_of_time())
    agreed = int(np.max(multihost_utils.process_allgather(np.int32(local))))
    self.reason = {0: None, 1: "train.max_hours reached", 2: "SIGTERM on some process"}[agreed]
    return agreed > 0

  def close(self) -> None:
    """Restore the previous SIGTERM handler."""
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
