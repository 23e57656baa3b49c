"""A pool of decode rows on device for one compiled setting (`serving.engine`): the requests
that hold or await its rows, admission, one device call per pass, and the tokens each row
settled passed on to its request.

A constrained pool (`SamplerSettings.constrained`) keeps its rows' automata in one table set
of a fixed capacity (`pool_tables`). Waiting requests are admitted in order, but for one whose
constraint does not fit beside the live rows' constraints: it waits for rows to free up, and
only unconstrained requests pass it meanwhile (a constrained one could keep it out for ever).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import jax
import numpy as np

from sbd_jax.decode import acceptance_prior, costs, policy
from sbd_jax.decode.sampler import prompt_bucket
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import default_tuning
from sbd_jax.serving import slots as slots_lib
from sbd_jax.serving.pool_tables import PoolTables
from sbd_jax.serving.requests import Finished, Request, Tokens


class Pool:
  """B rows on device for one compiled setting, and the requests that hold or await them."""

  def __init__(self, engine: Any, settings: SamplerSettings):  # engine: `engine.Engine`
    self.engine, self.settings = engine, settings
    e = engine
    self.static = dict(
      settings=settings,
      model_cfg=e.model.cfg,
      cache_length=settings.cache_slots(e.max_bucket, e.rows),
      mesh=e.mesh,
    )
    self.slots = slots_lib.init(rows=e.rows, **self.static)
    self.tables = None  # a constrained pool's automata (`pool_tables`)
    if settings.constrained:
      place = jax.device_put if e.mesh is None else lambda t: type(t)(*e.place(*t))
      self.tables = PoolTables(e.capacity, e.rows, e.model.cfg.vocab_size, settings.mask_id, place)
    # What the pool's verified rows have accepted, across requests: new rows start from it.
    self.prior = acceptance_prior.Prior()
    self.costs: costs.CostTable | None = None  # where the pool chooses its forwards
    self.tuning = default_tuning(settings)
    # A call of `advance` with every row idle: it compiles now, not at the first request, and
    # leaves the slots as every later call sees them (placed as `advance` returns them; from
    # `init` they would compile `admit` a second time, at the first request after one).
    self._advance(np.zeros(e.rows, bool), False)
    if settings.chooses_forwards:
      self.costs = costs.table_for(self._program_key(), settings, e.rows, self._forced)
      p = settings.block_size
      prior_P, learned = self.prior.by_position(p), self.prior.learned
      self.tuning = policy.Tuning.of(self.costs.cost_K, prior_P, -1, learned, block_size=p)
    self.holder: list[Request | None] = [None] * e.rows
    self.sent = np.zeros(e.rows, np.int64)  # settled tokens passed on, per row
    self.nfe = np.zeros(e.rows, np.int64)  # per row, as of the last call
    self.rollbacks = np.zeros(e.rows, np.int64)  # per row, as of the last call
    self.acceptance = None  # `slots.RowView.acceptance` of the last call
    self.complete = np.ones(e.rows, bool)  # per row, as of the last call
    self.forced = np.zeros(e.rows, np.int64)  # per row, as of the last call
    self.forwards = self.wide_forwards = 0  # of the rows, as of the last call
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
        taken = self._next(row)
        if taken is None:
          break
        self._admit(row, *taken)
        evict_B[row] = False  # the row's new prompt, not the cancelled one
    if self.busy == 0:
      return False
    self.last_used = time.monotonic()
    view = self._advance(evict_B, e.continuous and bool(self.waiting))
    self.evict_B = np.zeros(e.rows, bool)
    self.nfe, self.rollbacks, self.acceptance = view.nfe_B, view.rollbacks_B, view.acceptance
    self.complete, self.forced = view.complete_B, view.forced_B
    e.count_forwards(view.forwards - self.forwards, view.wide_forwards - self.wide_forwards)
    self.forwards, self.wide_forwards = view.forwards, view.wide_forwards
    for row, request in enumerate(self.holder):
      if request is None:
        continue
      settled = slice(self.sent[row], view.settled_B[row])
      new = [int(t) for t in view.tokens_BR[row, settled]]
      logprobs = [float(x) for x in view.logprob_BR[row, settled]]
      forwards = [int(x) for x in view.settled_at_BR[row, settled]]
      if new:
        self.sent[row] = view.settled_B[row]
        eos = s.eos_id >= 0 and new[-1] == s.eos_id
        if eos:
          new, logprobs = new[:-1], logprobs[:-1]
        piece = s.block_size if s.mode == "sbd" else 1
        for i in range(0, len(new), piece):  # an event per settled block (SBD) or token
          part = slice(i, i + piece)
          e.deliver(request, Tokens(new[part], logprobs[part], forwards[part]))
      if view.done_B[row]:
        n = int(view.settled_B[row])
        ends_in_eos = n > 0 and int(view.tokens_BR[row, n - 1]) == s.eos_id
        self._finish(row, "stop" if ends_in_eos else "length", int(view.nfe_B[row]))
    return True

  def _learn(self, row: int) -> None:
    """A finished verified row's draft tokens tried and rejected, by block position, join the
    pool's prior."""
    if self.acceptance is not None and self.settings.verified:
      a = self.acceptance
      self.prior.add(a.tried_in_block_BP[row], a.rejected_in_block_BP[row])
      prior_P = self.prior.by_position(self.settings.block_size)
      self.tuning = self.tuning.replace(prior_P=prior_P, learned=np.bool_(self.prior.learned))

  def _next(self, row: int) -> tuple[Request, int] | None:
    """The first waiting request that row `row` can take now, and its initial automaton state
    (the module docstring), taken off the queue; None if there is none."""
    blocked = False
    for request in self.waiting:
      state = 0
      if self.tables is not None and (request.constraint is None or not blocked):
        state = self.tables.place_row(row, request.constraint, request.automaton)
      if request.constraint is not None and (blocked or state is None):
        blocked = True
        continue
      self.waiting.remove(request)
      return request, state
    return None

  def _advance(self, evict_B: np.ndarray, stop_at_done: bool, tuning=None) -> slots_lib.RowView:
    """One `slots.advance` call with the pool's tuning (or `tuning`); its view of the rows."""
    e = self.engine
    t = self.tables
    self.slots, view_BX = slots_lib.advance(
      e.model.static_graph,
      e.model.weights,
      self.slots,
      evict_B,
      np.bool_(stop_at_done),
      self.tuning if tuning is None else tuning,
      None if t is None else t.ctables,
      None if t is None else t.shift_B(),
      forwards=e.forwards_per_call,
      **self.static,
    )
    return slots_lib.unpack(np.asarray(view_BX), self.settings.response_slots)

  def _program_key(self) -> str:
    e = self.engine
    mesh = None if e.mesh is None else tuple(e.mesh.shape.items())
    return costs.program_key(
      "advance", e.model.cfg, self.settings.with_traced_values(), e.rows, e.max_bucket,
      e.forwards_per_call, mesh,
    )  # fmt: skip

  def _forced(self, kind: int, limit: int) -> tuple[float, int]:
    """`costs.measure`'s timed run, before the pool serves: every row holds a placeholder
    prompt allowed `limit` tokens and decodes to its limit with forwards of one kind; the
    seconds and forwards of the `advance` calls. The rows are freed after."""
    e, s = self.engine, self.settings
    for row in range(e.rows):
      prompt = [s.pad_id] * e.min_bucket
      dummy = Request(prompt, s, 0.0, limit, row, emit=lambda event: None, verify=True)
      self._prefill(row, dummy)
    force = costs.forced(s, kind)
    before, seconds, done = int(self.slots.rows.forwards), 0.0, False
    while not done:
      began = time.perf_counter()
      view = self._advance(np.zeros(e.rows, bool), False, force)
      seconds += time.perf_counter() - began
      done = view.done_B.all()
    self._advance(np.ones(e.rows, bool), False)  # evicts every row
    return seconds, view.forwards - before

  def _admit(self, row: int, request: Request, cstate: int) -> None:
    self._prefill(row, request, cstate)
    self.holder[row], self.sent[row] = request, 0

  def _prefill(self, row: int, r: Request, cstate: int = 0) -> None:
    """Prefill `r`'s prompt into row `row`, its automaton at `cstate` (0: unconstrained)."""
    e, s = self.engine, self.settings
    q = prompt_bucket(len(r.prompt_ids), e.min_bucket)
    prompt_1Q = np.full((1, q), s.pad_id, np.int32)
    prompt_1Q[0, q - len(r.prompt_ids) :] = r.prompt_ids
    self.slots = slots_lib.admit(
      e.model.static_graph,
      e.model.weights,
      self.slots,
      np.int32(row),
      *e.place(prompt_1Q, np.array([len(r.prompt_ids)], np.int32)),
      np.uint32(r.seed),
      np.int32(r.index),
      np.int32(r.max_tokens),
      np.float32(r.gamma),
      np.float32(r.temperature),
      np.bool_(r.verify),
      None if self.tables is None else self.tables.ctables,
      np.int32(cstate),
      **self.static,
    )

  def compile_admissions(self) -> None:
    """Compile the admission of every prompt bucket (a prompt per bucket, prefilled into row 0
    and evicted), so that no request waits for a compilation."""
    e, q = self.engine, self.engine.min_bucket
    while True:
      prompt = [self.settings.pad_id] * (q // 2 + 1)
      self._prefill(0, Request(prompt, self.settings, 0.0, 1, 0, emit=lambda event: None))
      self.evict_B[0] = True
      self._advance(self.evict_B, False)
      self.evict_B[0] = False
      if q >= e.max_bucket:
        return
      q *= 2

  def _finish(self, row: int, reason: str, forwards: int) -> None:
    request = self.holder[row]
    self._learn(row)
    tokens = int(self.sent[row])
    if reason == "stop":
      tokens -= 1  # the EOS
    self.holder[row] = None
    structured = {}
    if self.tables is not None:
      self.tables.free(row)
    if request.constraint is not None:
      structured = dict(complete=bool(self.complete[row]), forced_tokens=int(self.forced[row]))
    drafts = {}
    if self.acceptance is not None:
      a = self.acceptance
      drafts = dict(
        drafts=int(a.drafts_B[row]),
        draft_tokens=int(a.draft_tokens_B[row]),
        accepted_tokens=int(a.accepted_B[row]),
        accepted_by_position=tuple(
          int(n) for n in a.accepted_at_BP[row, : self.settings.block_size - 1]
        ),
      )
    rollbacks = int(self.rollbacks[row])
    finished = Finished(reason, max(tokens, 0), forwards, rollbacks, **drafts, **structured)
    self.engine.finish(request, finished)

  def fail(self) -> None:
    """Answer every request of the pool with "error" (its step failed)."""
    for row, request in enumerate(self.holder):
      if request is not None:
        self._finish(row, "error", int(self.nfe[row]))
    while self.waiting:
      self.engine.finish(self.waiting.popleft(), Finished("error", 0, 0))
