"""The host loop of a server: requests in, tokens out, through fixed-shape rows on device.

One thread drives the device. Each pass it takes new requests from a bounded queue, frees the
rows of cancelled ones, prefills waiting prompts into free rows (`slots.admit`), then runs every
busy row a bounded number of forwards (`slots.advance`), which stops early when a row finishes
while prompts wait. A request that arrives while others decode joins at the next pass: a
finished row takes the next prompt without waiting for its neighbours (continuous batching).
With `continuous=False` a set of rows is instead admitted only when all of its rows are free,
each batch decoding until its slowest row is done (the baseline the load benchmark compares).

Decodes that differ in a compiled setting (mode, block size, rule, verification) cannot share
rows; each such setting gets its own `Pool` of rows, created on first use. At most `max_pools`
exist: a request for another setting waits until a pool is idle and gives way. γ, the
temperature, the token limit and the seed are per row: a server's pools sample (settings
temperature `TRACED_TEMPERATURE`), and a row at temperature 0 takes the argmax.

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
from sbd_jax.serving import slots as slots_lib
from sbd_jax.serving.requests import Finished, QueueFull, Request, ShuttingDown

log = logging.getLogger(__name__)


class Pool:
  """B rows on device for one compiled setting, and the requests that hold or await them."""

  def __init__(self, engine: "Engine", settings: SamplerSettings):
    self.engine, self.settings = engine, settings
    e = engine
    self.static = dict(
      settings=settings,
      model_cfg=e.model.cfg,
      cache_length=settings.cache_slots(e.max_bucket, e.rows),
      mesh=e.mesh,
    )
    self.slots = slots_lib.init(rows=e.rows, **self.static)
    # A call of `advance` with every row idle: it compiles now, not at the first request, and
    # leaves the slots as every later call sees them (placed as `advance` returns them; from
    # `init` they would compile `admit` a second time, at the first request after one).
    self.slots, _ = slots_lib.advance(
      e.model.static_graph,
      e.model.weights,
      self.slots,
      np.zeros(e.rows, bool),
      np.bool_(False),
      forwards=e.forwards_per_call,
      **self.static,
    )
    self.holder: list[Request | None] = [None] * e.rows
    self.sent = np.zeros(e.rows, np.int64)  # settled tokens passed on, per row
    self.nfe = np.zeros(e.rows, np.int64)  # per row, as of the last call
    self.rollbacks = np.zeros(e.rows, np.int64)  # per row, as of the last call
    self.waiting: collections.deque[Request] = collections.deque()
    self.last_used = time.monotonic()
    # Rows to stop on device at the next advance: freed rows keep decoding until one runs.
    self.evict_B = np.zeros(e.rows, bool)

  @property
  def busy(self) -> int:
    return sum(r is not None for r in self.holder)

  def idle(self) -> bool:
    return self.busy == 0 and not self.waiting

  def step(self) -> bool:
    """Free cancelled rows, admit waiting prompts, advance the busy rows. False if idle."""
    e, s = self.engine, self.settings
    evict_B = self.evict_B
    for row, request in enumerate(self.holder):
      if request is not None and request.cancelled.is_set():
        self._finish(row, request.cancel_reason, int(self.nfe[row]))
        evict_B[row] = True
    for request in [r for r in self.waiting if r.cancelled.is_set()]:
      self.waiting.remove(request)
      e.finish(request, Finished(request.cancel_reason, 0, 0))
    free = [row for row, request in enumerate(self.holder) if request is None]
    if e.continuous or len(free) == e.rows:
      for row in free:
        if not self.waiting:
          break
        self._admit(row, self.waiting.popleft())
        evict_B[row] = False  # the row's new prompt, not the cancelled one
    if self.busy == 0:
      return False
    self.last_used = time.monotonic()
    self.slots, view_BX = slots_lib.advance(
      e.model.static_graph,
      e.model.weights,
      self.slots,
      evict_B,
      np.bool_(e.continuous and bool(self.waiting)),
      forwards=e.forwards_per_call,
      **self.static,
    )
    self.evict_B = np.zeros(e.rows, bool)
    view = slots_lib.unpack(np.asarray(view_BX))
    self.nfe, self.rollbacks = view.nfe_B, view.rollbacks_B
    for row, request in enumerate(self.holder):
      if request is None:
        continue
      new = [int(t) for t in view.tokens_BR[row, self.sent[row] : view.settled_B[row]]]
      if new:
        self.sent[row] = view.settled_B[row]
        eos = s.eos_id >= 0 and new[-1] == s.eos_id
        if eos:
          new = new[:-1]
        piece = s.block_size if s.mode == "sbd" else 1
        for i in range(0, len(new), piece):  # an event per settled block (SBD) or token
          e.deliver(request, new[i : i + piece])
      if view.done_B[row]:
        n = int(view.settled_B[row])
        ends_in_eos = n > 0 and int(view.tokens_BR[row, n - 1]) == s.eos_id
        self._finish(row, "stop" if ends_in_eos else "length", int(view.nfe_B[row]))
    return True

  def _admit(self, row: int, request: Request) -> None:
    self._prefill(row, request.prompt_ids, request)
    self.holder[row], self.sent[row] = request, 0

  def _prefill(self, row: int, prompt_ids: list[int], request: Request | None) -> None:
    e, s = self.engine, self.settings
    q = prompt_bucket(len(prompt_ids), e.min_bucket)
    prompt_1Q = np.full((1, q), s.pad_id, np.int32)
    prompt_1Q[0, q - len(prompt_ids) :] = prompt_ids
    r = request
    self.slots = slots_lib.admit(
      e.model.static_graph,
      e.model.weights,
      self.slots,
      np.int32(row),
      *e.place(prompt_1Q, np.array([len(prompt_ids)], np.int32)),
      np.uint32(r.seed if r else 0),
      np.int32(r.index if r else 0),
      np.int32(r.max_tokens if r else 1),
      np.float32(r.gamma if r else 0.0),
      np.float32(r.temperature if r else 0.0),
      **self.static,
    )

  def compile_admissions(self) -> None:
    """Compile the admission of every prompt bucket (a prompt per bucket, prefilled into row 0
    and evicted), so that no request waits for a compilation."""
    e, q = self.engine, self.engine.min_bucket
    while True:
      self._prefill(0, [self.settings.pad_id] * (q // 2 + 1), None)
      self.evict_B[0] = True
      self.slots, _ = slots_lib.advance(
        e.model.static_graph,
        e.model.weights,
        self.slots,
        self.evict_B,
        np.bool_(False),
        forwards=e.forwards_per_call,
        **self.static,
      )
      self.evict_B[0] = False
      if q >= e.max_bucket:
        return
      q *= 2

  def _finish(self, row: int, reason: str, forwards: int) -> None:
    request = self.holder[row]
    tokens = int(self.sent[row])
    if reason == "stop":
      tokens -= 1  # the EOS
    self.holder[row] = None
    rollbacks = int(self.rollbacks[row])
    self.engine.finish(request, Finished(reason, max(tokens, 0), forwards, rollbacks))

  def fail(self) -> None:
    """Answer every request of the pool with "error" (its step failed)."""
    for row, request in enumerate(self.holder):
      if request is not None:
        self._finish(row, "error", int(self.nfe[row]))
    while self.waiting:
      self.engine.finish(self.waiting.popleft(), Finished("error", 0, 0))


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
    serve_only: Sequence[SamplerSettings] = (),
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
    self.max_bucket = prompt_bucket(max_prompt_tokens, min_bucket)
    self.max_queue, self.forwards_per_call = max_queue, forwards_per_call
    self.continuous, self.max_pools = continuous, max_pools
    self.max_failures, self.on_failure = max_failures, on_failure
    # An allow-list: only these pools, every one made (allocated and compiled) by `start`.
    self.serve_only = tuple(dict.fromkeys(serve_only))
    self.pools: dict[SamplerSettings, Pool] = {}
    self._incoming: collections.deque[Request] = collections.deque()
    self._parked: collections.deque[Request] = collections.deque()  # for a pool not yet made
    self._wake = threading.Condition()
    self._admitting, self._stopped = True, False
    self._live: set[Request] = set()  # submitted and not yet finished
    self.finished: collections.Counter[str] = collections.Counter()  # requests, by reason
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
    return self

  def serves(self, settings: SamplerSettings) -> bool:
    """Whether a request with these compiled settings can be decoded (an allow-list's)."""
    return not self.serve_only or settings in self.serve_only

  def submit(self, request: Request) -> None:
    """Queue a request, or raise QueueFull / ShuttingDown (ValueError: settings outside the
    allow-list, which callers check first: `serves`)."""
    if not self.serves(request.settings):
      raise ValueError(f"settings outside the allow-list: {request.settings}")
    with self._wake:
      if not self._admitting or self.error is not None:
        raise ShuttingDown("the server is shutting down" if self.error is None else "engine failed")
      if self.waiting() >= self.max_queue:
        raise QueueFull(f"{self.max_queue} requests are already waiting; retry later")
      self._incoming.append(request)
      self._live.add(request)
      self._wake.notify()

  def waiting(self) -> int:
    """Requests not yet in a row."""
    pools = list(self.pools.values())
    return len(self._incoming) + len(self._parked) + sum(len(p.waiting) for p in pools)

  def alive(self) -> bool:
    """The engine thread runs and admits requests: what /health reports as 200."""
    return self._thread.is_alive() and self.error is None and self._admitting

  def busy_rows(self) -> int:
    return sum(p.busy for p in list(self.pools.values()))

  def stop_admitting(self) -> None:
    with self._wake:
      self._admitting = False
      self._wake.notify()

  def drain(self, deadline_s: float) -> None:
    """Stop admitting, let in-flight requests finish for up to `deadline_s`, cancel the rest
    (each then finishes as "shutdown" at the next pass), and stop the thread."""
    self.stop_admitting()
    end = time.monotonic() + deadline_s
    while self._live and self.error is None and time.monotonic() < end:
      time.sleep(0.01)
    for request in self._all_requests():
      request.cancel("shutdown")
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
    with self._wake:
      self._live.discard(request)
      self.finished[event.reason] += 1
    self.deliver(request, event)

  def deliver(self, request: Request, event: Any) -> None:
    """`request.emit(event)`; an emit that raises cancels its request, not the engine."""
    try:
      request.emit(event)
    except Exception:
      log.exception("a request's event callback failed; the request is cancelled")
      request.cancel("error")

  def _all_requests(self) -> list[Request]:
    with self._wake:
      return list(self._live)

  def _take_incoming(self) -> bool:
    """Wait for work; place new and parked requests in their pools. False if making a pool
    failed (its requests answered "error")."""
    with self._wake:
      while (
        not self._stopped
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
      self.pools[key] = Pool(self, key)
    return self.pools[key]

  def _pass(self) -> bool:
    """One pass over the pools; False if a pool failed (its requests answered "error")."""
    ok = True
    for key, pool in list(self.pools.items()):
      try:
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
        if self._stopped:
          return
        stepped = self._pass()
        failures = 0 if placed and stepped else failures + 1
        if failures >= self.max_failures:
          raise RuntimeError(f"{failures} passes in a row failed: the device is gone")
    except BaseException as e:  # every request gets an answer, the server learns it
      log.exception("the decode engine stopped")
      self.error = e
      for request in self._all_requests():
        self.finish(request, Finished("error", 0, 0))
      if self.on_failure is not None:
        self.on_failure(e)
