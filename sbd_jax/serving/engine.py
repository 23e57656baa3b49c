"""The host loop of a server: requests in, tokens out, through fixed-shape rows on device.

One thread drives the device. Each pass it takes new requests from a bounded queue, frees the
rows of cancelled ones, prefills waiting prompts into free rows (`slots.admit`), then runs every
busy row a bounded number of forwards (`slots.advance`), which stops early when a row finishes
while prompts wait. A request that arrives while others decode joins at the next pass: a
finished row takes the next prompt without waiting for its neighbours (continuous batching).
With `continuous=False` a set of rows is instead admitted only when all of its rows are free,
each batch decoding until its slowest row is done (the baseline the load benchmark compares).

Decodes that differ in a compiled setting (mode, block size, rule) cannot share rows; each
such setting gets its own `Pool` of rows, created on first use. At most `max_pools` exist: a
request for another setting waits until a pool is idle and gives way. γ, the temperature, the
token limit, the seed and verification are per row: a server's pools sample (settings
temperature `TRACED_TEMPERATURE`), and a row at temperature 0 takes the argmax; its SBD pools
can verify (`SamplerSettings.verify`), and a row that does not decodes as plain SBD.

A request may carry a constraint (`Request.constraint`, with its compiled automaton): a
server's pools are then compiled constrained, and rows with different constraints, and none,
share a pool (`pool_tables`).

Each request receives its tokens through `Request.emit` as they settle (a block at a time for
SBD, a token at a time for NTP; `slots.settled`), then one `Finished` event. Emits run on the
engine thread: the caller hands them to its own event loop; an emit that raises cancels its
own request only.

A pool whose step fails (a compile that does not fit, a device error) answers its requests with
"error" and is dropped; the engine goes on. `max_failures` failed passes in a row mean the
device is gone: the engine stops, answers every request, and reports `error` (the server's
/health then answers 503 and the process exits non-zero).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sbd_jax import sharding
from sbd_jax.decode import compiled
from sbd_jax.decode.sampler import SamplingModel, prompt_bucket
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.serving.pool import Pool
from sbd_jax.serving.pool_tables import Capacity
from sbd_jax.serving.requests import Finished, QueueFull, Request, ShuttingDown

log = logging.getLogger(__name__)


class Engine:
  """Requests through `rows` rows per compiled setting, on one device or a mesh."""

  def __init__(
    self,
    model: SamplingModel,
    *,
    rows: int = 8,
    max_prompt_tokens: int = 512,
    max_queue: int = 256,
    forwards_per_call: int = 8,
    continuous: bool = True,
    max_pools: int = 2,
    mesh=None,
    min_bucket: int = 16,
    max_failures: int = 3,
    on_failure: Callable[[BaseException], None] | None = None,
    step_timeout_s: float = 300.0,
    serve_only: Sequence[SamplerSettings] = (),
    capacity: Capacity | None = None,
  ):
    if rows < 1 or forwards_per_call < 1 or max_queue < 1 or max_pools < 1:
      raise ValueError("rows, forwards_per_call, max_queue and max_pools must be >= 1")
    if len(serve_only) > max_pools:
      raise ValueError(
        f"max_pools={max_pools} is fewer than the {len(serve_only)} pools the allow-list serves"
      )
    ways = sharding.row_shards(mesh)
    if rows % ways:
      raise ValueError(f"rows={rows} must be a multiple of the mesh's {ways} row shards")
    self.model = model.sharded(mesh) if mesh is not None else model
    self.rows, self.mesh, self.min_bucket = rows, mesh, min_bucket
    self.max_prompt_tokens = max_prompt_tokens
    self.max_bucket = prompt_bucket(max_prompt_tokens, min_bucket)
    self.max_queue, self.forwards_per_call = max_queue, forwards_per_call
    self.continuous, self.max_pools = continuous, max_pools
    self.max_failures, self.on_failure = max_failures, on_failure
    # A device step running longer than this (a hung device, a stuck collective) stops the
    # engine as a failure; 0 = no watchdog. Making a pool on first use (allocating and
    # compiling it: no allow-list) counts as a step, and so does a first admission's compile.
    self.step_timeout_s = step_timeout_s
    self._step_began: float | None = None
    # An allow-list: only these pools, every one made (allocated and compiled) by `start`.
    self.serve_only = tuple(dict.fromkeys(serve_only))
    self.capacity = capacity or Capacity()  # a constrained pool's table set's (`pool_tables`)
    self.pools: dict[SamplerSettings, Pool] = {}
    self._incoming: collections.deque[Request] = collections.deque()
    self._parked: collections.deque[Request] = collections.deque()  # for a pool not yet made
    self._wake = threading.Condition()
    self._admitting, self._stopped = True, False
    self._live: set[Request] = set()  # submitted and not yet finished
    self.finished: collections.Counter[str] = collections.Counter()  # requests, by reason
    self.forwards = self.wide_forwards = 0  # device forwards of every pool (prefills apart)
    self._thread = threading.Thread(target=self._run, name="sbd-engine", daemon=True)
    self.error: BaseException | None = None

  # -- the caller's side ---------------------------------------------------------------------

  def start(self) -> "Engine":
    """Start the engine thread; with an allow-list, first make every pool it serves (KV caches
    allocated, every step and prompt bucket compiled): one that does not fit fails here,
    before a request is taken."""
    for settings in self.serve_only:
      pool = self.pools[settings] = Pool(self, settings)
      pool.compile_admissions()
    self._thread.start()
    if self.step_timeout_s > 0:
      threading.Thread(target=self._watch, name="sbd-engine-watchdog", daemon=True).start()
    return self

  def serves(self, settings: SamplerSettings) -> bool:
    """Whether a request with these compiled settings can be decoded (an allow-list's)."""
    return not self.serve_only or settings in self.serve_only

  def submit(self, *requests: Request) -> None:
    """Queue requests, all or none: QueueFull / ShuttingDown, or ValueError for settings outside
    the allow-list (callers check `serves` first), a prompt the pools' caches cannot hold
    (longer than `max_prompt_tokens`: its cache writes would land on the wrong slots), or a
    constraint without its automaton, in settings that are not constrained, or larger than a
    pool's tables (a ConstraintError)."""
    for request in requests:
      if not self.serves(request.settings):
        raise ValueError(f"settings outside the allow-list: {request.settings}")
      if request.constraint is not None:
        if request.automaton is None or not request.settings.constrained:
          raise ValueError("a constraint needs its automaton and constrained settings")
        self.capacity.check(request.automaton)
      if not 1 <= len(request.prompt_ids) <= self.max_prompt_tokens:
        raise ValueError(
          f"a prompt of {len(request.prompt_ids)} tokens: the pools take 1 to "
          f"max_prompt_tokens={self.max_prompt_tokens}"
        )
    with self._wake:
      if not self._admitting or self.error is not None:
        raise ShuttingDown("the server is shutting down" if self.error is None else "engine failed")
      if self.waiting() + len(requests) > self.max_queue:
        raise QueueFull(f"{self.max_queue} requests may wait and {self.waiting()} do; retry later")
      self._incoming.extend(requests)
      self._live.update(requests)
      self._wake.notify()

  def waiting(self) -> int:
    """Requests not yet in a row."""
    pools = list(self.pools.values())
    return len(self._incoming) + len(self._parked) + sum(len(p.waiting) for p in pools)

  def alive(self) -> bool:
    """The engine thread runs and admits requests: what /health reports as 200."""
    return self._thread.is_alive() and self.error is None and self._admitting

  def unfinished(self) -> int:
    """Requests submitted and not yet finished: waiting, being placed in a pool, or in a row."""
    with self._wake:
      return len(self._live)

  def busy_rows(self) -> int:
    return sum(p.busy for p in list(self.pools.values()))

  def row_occupancy(self) -> float:
    """Busy rows over the rows on device (every pool's)."""
    return self.busy_rows() / max(1, self.rows * len(self.pools))

  def wide_forward_share(self) -> float:
    """The share of the device forwards that were wide (2P tokens: a block's first pass)."""
    return self.wide_forwards / max(1, self.forwards)

  def count_forwards(self, forwards: int, wide: int) -> None:
    self.forwards += forwards
    self.wide_forwards += wide

  def stop_admitting(self) -> None:
    with self._wake:
      self._admitting = False
      self._wake.notify()

  def cancel_all(self, reason: str) -> None:
    """Cancel every request not yet finished (each finishes with `reason` at the next pass)."""
    for request in self._all_requests():
      request.cancel(reason)

  def drain(self, deadline_s: float) -> None:
    """Stop admitting, let in-flight requests finish for up to `deadline_s`, cancel the rest
    (each then finishes as "shutdown" at the next pass), and stop the thread."""
    self.stop_admitting()
    end = time.monotonic() + deadline_s
    while self._live and self.error is None and time.monotonic() < end:
      time.sleep(0.01)
    self.cancel_all("shutdown")
    while self._live and self.error is None and time.monotonic() < end + 10:
      time.sleep(0.01)
    with self._wake:
      self._stopped = True
      self._wake.notify()
    if self._thread.is_alive():
      self._thread.join(timeout=10)

  @staticmethod
  def compilations() -> int:
    return compiled.compiled_count()

  def place(self, *arrays: np.ndarray):
    """Host arrays as the decode takes them: replicated over the mesh (one device: as is)."""
    if self.mesh is None:
      return arrays
    return jax.device_put(arrays, sharding.replicated(self.mesh))

  # -- the engine thread ---------------------------------------------------------------------

  def finish(self, request: Request, event: Finished) -> None:
    """A request's last event, once: a request already finished (answered "error" when the
    engine failed, say, while its step still ran) gets nothing more."""
    with self._wake:
      if request not in self._live:
        return
      self._live.discard(request)
      self.finished[event.reason] += 1
    self._emit(request, event)

  def deliver(self, request: Request, event: Any) -> None:
    """A request's event, unless it has finished."""
    if request in self._live:
      self._emit(request, event)

  def _emit(self, request: Request, event: Any) -> None:
    """`request.emit(event)`; an emit that raises cancels its request, not the engine."""
    try:
      request.emit(event)
    except Exception:
      log.exception("a request's event callback failed; the request is cancelled")
      request.cancel("error")

  @contextlib.contextmanager
  def _timed(self):
    """Work the watchdog times: a device step, or the making of a pool."""
    self._step_began = time.monotonic()
    try:
      yield
    finally:
      self._step_began = None

  def _all_requests(self) -> list[Request]:
    with self._wake:
      return list(self._live)

  def _take_incoming(self) -> bool:
    """Wait for work; place new and parked requests in their pools. False if making a pool
    failed (its requests answered "error")."""
    with self._wake:
      while (
        not self._stopped
        and self.error is None
        and not self._incoming
        and not self._parked
        and not any(not p.idle() for p in self.pools.values())
      ):
        self._wake.wait()
      incoming, self._incoming = list(self._incoming), collections.deque()
    parked, self._parked = [*self._parked, *incoming], collections.deque()
    ok = True
    for request in parked:
      if request.cancelled.is_set():
        self.finish(request, Finished(request.cancel_reason, 0, 0))
        continue
      try:
        pool = self._pool_for(request)
      except Exception:  # e.g. its cache does not fit: this request fails, the engine goes on
        log.exception("a decode pool could not be made")
        self.finish(request, Finished("error", 0, 0))
        ok = False
        continue
      if pool is None:
        self._parked.append(request)  # every pool is busy with another setting
      else:
        pool.waiting.append(request)
    return ok

  def _pool_for(self, request: Request) -> Pool | None:
    """The pool of the request's setting; made if `max_pools` allows, an idle pool giving way;
    None while every pool is busy with another setting."""
    key = request.settings
    if key not in self.pools:
      idle = sorted((p.last_used, k) for k, p in self.pools.items() if p.idle())
      while len(self.pools) >= self.max_pools and idle:
        del self.pools[idle.pop(0)[1]]
      if len(self.pools) >= self.max_pools:
        return None
      with self._timed():
        self.pools[key] = Pool(self, key)
    return self.pools[key]

  def _pass(self) -> bool:
    """One pass over the pools; False if a pool failed (its requests answered "error")."""
    ok = True
    for key, pool in list(self.pools.items()):
      try:
        with self._timed():
          pool.step()
      except Exception:
        log.exception("a decode pool failed; its requests end with an error")
        del self.pools[key]
        pool.fail()
        ok = False
    return ok

  def _run(self) -> None:
    failures = 0
    try:
      while True:
        placed = self._take_incoming()
        if self._stopped or self.error is not None:  # (the watchdog's verdict)
          return
        stepped = self._pass()
        failures = 0 if placed and stepped else failures + 1
        if failures >= self.max_failures:
          raise RuntimeError(f"{failures} passes in a row failed: the device is gone")
    except BaseException as e:
      log.exception("the decode engine stopped")
      self._fail(e)

  def _fail(self, error: BaseException) -> None:
    """The engine is done for: every request gets an answer, and the server learns it."""
    with self._wake:
      if self.error is not None:
        return
      self.error = error
      self._wake.notify()
    for request in self._all_requests():
      self.finish(request, Finished("error", 0, 0))
    if self.on_failure is not None:
      self.on_failure(error)

  def _watch(self) -> None:
    """The watchdog: a step or the making of a pool that runs past `step_timeout_s` fails the
    engine (from this thread: the engine's own is stuck in it)."""
    period = min(1.0, self.step_timeout_s / 4)
    while not self._stopped and self.error is None:
      time.sleep(period)
      began = self._step_began
      if began is not None and time.monotonic() - began > self.step_timeout_s:
        log.error("a device step has run for more than %g s", self.step_timeout_s)
        self._fail(
          TimeoutError(f"a device step ran for more than {self.step_timeout_s:g} s: it hangs")
        )
        return
