"""Continuous batching: a queue of prompts decoded through B rows in one jitted `while_loop`,
a finished row taking the next prompt at once (`SamplerSettings.refill`).

A batch decoded on its own (`compiled.decode_batch`) runs until its slowest row is done, so its
finished rows idle, for NTP and SBD alike (BENCHMARKS.md, batch throughput). Here, whenever a row
is done and prompts are waiting, the row's results go to the output and the next prompt is
prefilled into that row alone (a one-row forward over a fresh cache row), while the other rows
keep their caches and blocks. Each prompt's tokens, reveal steps and NFE are those of decoding it
alone: rows move through their blocks alone (SBD) and keep a token slot each (NTP), so nothing a
row computes depends on its neighbours (but for a verified row's NTP forwards, a batch's choice:
`loop`; its text is NTP's anyway).

Loop structure, every level a `while_loop` (no host round trip):

    while a row is decoding or a prompt waits:
      while a row is done and a prompt waits: flush the row, prefill the next prompt into it
      forwards and reveals of all rows (`loop.decode_while`), until a row is done while
        a prompt waits, or every row is done

Dimension letters (docs/dimensions.md): J queued prompts (padded to a bucket; `queued` of them
are real), B rows, E rows refilled together (`refill_rows`), Q prompt slots, R response slots.

Accounting. A prompt's `row_forwards` are the forwards its row ran while holding it: its own
prefill, then every B-row forward until the row took the next prompt or the loop ended (a row
whose queue ran dry idles to the end, and that idling is charged to its last prompt). So
sum(NFE) / sum(row_forwards) is the share of row-forwards that did work, as for batches.
Prefills are one-row forwards. Results equal a lone decode's, sampled ones (temperature > 0)
too: every prompt draws from its own key (`state.prompt_keys`).

Cost. Every prompt is prefilled alone. On an accelerator a decode forward is memory-bound and a
prompt's prefill compute-bound, so a prefill costs about the same alone as in a batch, and the
B-row forwards that refill saves are the expensive ones. On a CPU small matmuls are less
efficient, and one-row prefills give back part of the gain; `refill_rows` prefills several
finished rows together.

On a mesh, as the batch decode: one SPMD program, the rows split over (data, fsdp), weights as
placed (SAMPLING_RULES), the queue and the outputs replicated; every device runs the same loop
and refills. An E-row prefill is split over (data, fsdp) like a batch of E rows, so with E
below the number of row shards the devices repeat each other's prefill work (XLA's FLOP count
for llama8b on v5p-8: one row costs every chip what four rows split four ways do).
With `refill_rows` a multiple of data x fsdp, each prefill is split evenly; its rows then
move to the shards holding the rows they refill.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from sbd_jax import sharding
from sbd_jax.decode import compiled, loop
from sbd_jax.decode.acceptance import Acceptance
from sbd_jax.decode.compiled import StaticGraph
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState, RowLayout, initial_state, prompt_keys
from sbd_jax.model.kv_cache import KVCache


@flax.struct.dataclass
class QueueState:
  """Loop carry: the rows' decode, which queued prompt each row holds, and the outputs (one
  spare row, index J, takes the writes of rows that hold none)."""

  rows: DecodeState
  layout: RowLayout
  prompt_B: jax.Array  # int32: the queued prompt the row holds; J: none
  entered_B: jax.Array  # int32: `rows.forwards` when the row took its prompt
  entered_wide_B: jax.Array  # int32: `rows.wide_forwards` then
  entered_ntp_B: jax.Array  # int32: `rows.ntp_forwards` then
  next: jax.Array  # int32 scalar: the first prompt still waiting
  prefills: jax.Array  # int32 scalar
  tokens_JR: jax.Array
  reveal_step_JR: jax.Array
  nfe_J: jax.Array
  length_J: jax.Array
  rollbacks_J: jax.Array
  cstate_J: jax.Array  # constrained: the automaton state each prompt's text ended in
  forced_J: jax.Array
  acceptance_J: Acceptance
  row_forwards_J: jax.Array
  row_wide_forwards_J: jax.Array
  row_ntp_forwards_J: jax.Array


def _start(rows: DecodeState, queued: int, s: SamplerSettings) -> QueueState:
  """No prompt taken: every row holds none (prompt J) and the J + 1 outputs are empty."""
  b, j, r = rows.nfe_B.shape[0], queued, s.response_slots
  zeros = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
  return QueueState(
    rows=rows,
    layout=RowLayout.of(jnp.ones((b,), jnp.int32), r),
    prompt_B=jnp.full((b,), j, jnp.int32),
    entered_B=zeros(b),
    entered_wide_B=zeros(b),
    entered_ntp_B=zeros(b),
    next=zeros(),
    prefills=zeros(),
    tokens_JR=jnp.full((j + 1, r), s.mask_id, jnp.int32),
    reveal_step_JR=zeros(j + 1, r),
    nfe_J=zeros(j + 1),
    length_J=zeros(j + 1),
    rollbacks_J=zeros(j + 1),
    cstate_J=zeros(j + 1),
    forced_J=zeros(j + 1),
    acceptance_J=Acceptance.zeros(j + 1, s.block_size),
    row_forwards_J=zeros(j + 1),
    row_wide_forwards_J=zeros(j + 1),
    row_ntp_forwards_J=zeros(j + 1),
  )


def put_state(
  st: DecodeState, rows_E: jax.Array, new: DecodeState, by_select: bool = False
) -> DecodeState:
  """`st` with rows `rows_E` replaced by the E-row state `new` (cache rows and ends included;
  a row index of B or more is dropped); the batch's forward counts stay `st`'s."""
  per_row = (
    "tokens_BR logprob_BR reveal_step_BR nfe_B length_B limit_B done_B index commit_B verified_B "
    "rollbacks_B acceptance estimates key_B temperature_B verify_B cstate_B forced_B"
  ).split()
  put_one = functools.partial(put_rows, rows_E=rows_E, by_select=by_select)
  put = lambda a, b: jax.tree.map(lambda x, y: put_one(x, x_E=y), a, b)  # noqa: E731
  cache = st.cache.replace(
    k=put(st.cache.k, new.cache.k),
    v=put(st.cache.v, new.cache.v),
    meta=put(st.cache.meta, new.cache.meta),
    end=put(st.cache.end, new.cache.end),
  )
  return st.replace(**{f: put(getattr(st, f), getattr(new, f)) for f in per_row}, cache=cache)


def put_rows(
  x_B: jax.Array, rows_E: jax.Array, x_E: jax.Array, by_select: bool = False
) -> jax.Array:
  """x_B with x_B[rows_E[i]] = x_E[i] (rows past the end are dropped): a scatter along the
  first axis, in place, or `by_select` (one row) a select, which passes over all of x_B.

  XLA rewrites a one-row scatter as a dynamic-update-slice. On TPU, where NTP's one-token
  forwards keep the cache in a layout of their own (slots minor), that update of a cache whose
  rows are split over devices made XLA copy every cache layer to the prefill's layout and back
  at each refill (2 layers of llama8b on v5p-8: 12 copies of whole layers; none with the
  select, which works in the cache's layout). Elsewhere the scatter stays: with unsplit rows it
  updates in place, and SBD's cache has one layout throughout (llama8b's SBD refill on v5p-8:
  17.33 GiB per chip with the scatter, 17.60 with the select)."""
  if by_select:
    (row,) = rows_E
    hit_B = (jnp.arange(x_B.shape[0]) == row).reshape((-1,) + (1,) * (x_B.ndim - 1))
    return jnp.where(hit_B, x_E[0].astype(x_B.dtype), x_B)
  return x_B.at[rows_E].set(x_E.astype(x_B.dtype), mode="drop")


def _flush(q: QueueState, done_B: jax.Array) -> QueueState:
  """Write the results of the rows in `done_B` to their prompts' outputs (rows holding no
  prompt write to the spare output row)."""
  j = q.nfe_J.shape[0] - 1
  target_B = jnp.where(done_B, q.prompt_B, j)
  st = q.rows
  put = lambda out, x: out.at[target_B].set(x)  # noqa: E731
  return q.replace(
    tokens_JR=put(q.tokens_JR, st.tokens_BR),
    reveal_step_JR=put(q.reveal_step_JR, st.reveal_step_BR),
    nfe_J=put(q.nfe_J, st.nfe_B),
    length_J=put(q.length_J, st.length_B),
    rollbacks_J=put(q.rollbacks_J, st.rollbacks_B),
    cstate_J=put(q.cstate_J, st.cstate_B),
    forced_J=put(q.forced_J, st.forced_B),
    acceptance_J=jax.tree.map(put, q.acceptance_J, st.acceptance),
    row_forwards_J=put(q.row_forwards_J, st.forwards - q.entered_B + 1),
    row_wide_forwards_J=put(q.row_wide_forwards_J, st.wide_forwards - q.entered_wide_B),
    row_ntp_forwards_J=put(q.row_ntp_forwards_J, st.ntp_forwards - q.entered_ntp_B),
  )


def _decode_queue(
  graphdef,
  state,
  prompt_JQ,
  prompt_len_J,
  queued,
  seed,
  gamma,
  temperature,
  tuning,
  limit,
  ctables,
  first_state_J,
  *,
  rows,
  settings,
  model_cfg,
  cache_length,
  mesh,
):
  """Decode prompts [0, queued) of `prompt_JQ` through `rows` rows, each of at most `limit`
  tokens (constrained: from its automaton state in `first_state_J`): the final `QueueState`."""
  s = settings
  j, l = prompt_JQ.shape
  b, r = rows, s.response_slots
  alone = s.rows_move_alone(b)
  if cache_length < s.cache_slots(l, b):
    raise ValueError(f"cache_length {cache_length} < the {s.cache_slots(l, b)} slots needed")
  heads_first = loop.platform(mesh) == "tpu"
  forward = functools.partial(loop.model_forward, graphdef, state, mesh=mesh)
  cache = KVCache.empty(model_cfg, b, cache_length, heads_first=heads_first)
  cache = cache.replace(end=jnp.zeros((b,), jnp.int32))
  rows_st = initial_state(
    s, cache, prompt_keys(seed, jnp.full((b,), j)), jnp.ones((b,), bool), True, temperature,
    tuning=tuning, ctables=ctables,
  )  # fmt: skip
  limit = jnp.minimum(jnp.asarray(limit, jnp.int32), s.max_new_tokens)
  q = _start(rows_st, j, s)
  active_B = jnp.ones((b,), bool)

  e = min(s.refill_rows, b)
  slot_E = jnp.arange(e)
  by_select = s.mode == "ntp" and e == 1 and sharding.row_shards(mesh) > 1  # see `put_rows`

  def waiting(q: QueueState) -> jax.Array:
    return q.next < queued

  def group(q: QueueState) -> jax.Array:
    """How many prompts the next refill takes: E, fewer at the end of the queue."""
    return jnp.minimum(e, queued - q.next)

  def refill_due(done_B: jax.Array, group: jax.Array) -> jax.Array:
    return (group > 0) & (jnp.sum(done_B) >= group)

  def take_next(q: QueueState) -> QueueState:
    """Flush the first `group` finished rows and prefill as many waiting prompts into them, in
    one E-row forward (the rows past `group` are computed and dropped)."""
    (done_E,) = jnp.nonzero(q.rows.done_B, size=e, fill_value=b)
    rows_E = jnp.where(slot_E < group(q), done_E, b)  # b: dropped
    q = _flush(q, jnp.zeros((b,), bool).at[rows_E].set(True, mode="drop"))
    prompt_E = jnp.minimum(q.next + slot_E, j - 1)
    layout_E = RowLayout.of(prompt_len_J[prompt_E], r)
    cache_E = KVCache.empty(model_cfg, e, cache_length, heads_first=heads_first)
    keys_E = prompt_keys(seed, q.next + slot_E)
    new = initial_state(
      s, cache_E, keys_E, slot_E < 0, row_index=True, temperature=temperature,
      tuning=q.rows.tuning, ctables=ctables,
      cstate=0 if first_state_J is None else first_state_J[prompt_E],
    )  # fmt: skip
    new = new.replace(limit_B=jnp.full((e,), limit, jnp.int32), eos_id=q.rows.eos_id)
    new = loop.prefill(
      new, prompt_JQ[prompt_E], layout_E, forward, s, gamma, slot_E >= 0, alone=True
    )
    put = lambda x_B, x_E: put_rows(x_B, rows_E, x_E, by_select)  # noqa: E731
    return q.replace(
      rows=put_state(q.rows, rows_E, new, by_select),
      layout=jax.tree.map(put, q.layout, layout_E),
      prompt_B=put(q.prompt_B, q.next + slot_E),
      entered_B=put(q.entered_B, jnp.broadcast_to(q.rows.forwards, (e,))),
      entered_wide_B=put(q.entered_wide_B, jnp.broadcast_to(q.rows.wide_forwards, (e,))),
      entered_ntp_B=put(q.entered_ntp_B, jnp.broadcast_to(q.rows.ntp_forwards, (e,))),
      next=q.next + group(q),
      prefills=q.prefills + 1,
    )

  def serve(q: QueueState) -> QueueState:
    q = jax.lax.while_loop(lambda q: refill_due(q.rows.done_B, group(q)), take_next, q)
    next_group = group(q)  # the rows decode until that many of them are done

    def go(st: DecodeState) -> jax.Array:
      return ~jnp.all(st.done_B) & ~refill_due(st.done_B, next_group)

    st = loop.decode_while(q.rows, q.layout, forward, s, gamma, active_B, alone, go)
    return q.replace(rows=st)

  q = jax.lax.while_loop(lambda q: ~jnp.all(q.rows.done_B) | waiting(q), serve, q)
  return _flush(q, jnp.ones((b,), bool))


@functools.partial(
  jax.jit, static_argnames=("graph", "rows", "settings", "model_cfg", "cache_length", "mesh")
)
def decode_queue(
  graph: StaticGraph,
  weights: list,
  prompt_JQ,
  prompt_len_J,
  queued,
  seed,
  gamma,
  temperature,
  tuning,
  limit,
  ctables=None,
  first_state_J=None,
  *,
  rows,
  settings,
  model_cfg,
  cache_length,
  mesh=None,
):
  """`_decode_queue` compiled per (shapes, rows, settings without γ and temperature); `queued` (how
  many of the J prompts are real), `gamma`, `temperature`, the tuning (`policy.Tuning`), the
  token limit, and a constrained decode's tables and prompts' initial states are traced. Returns `compiled.pack`'s
  int32 array [J, 2R + P + K + 15]: one row per queued prompt. With a mesh, as
  `compiled.decode_batch`: rows split over (data, fsdp), weights as placed, the result replicated
  on every device."""
  compiled.count_compilation()
  kwargs = dict(rows=rows, settings=settings, model_cfg=model_cfg, cache_length=cache_length)
  args = (graph.graphdef, graph.state(weights), prompt_JQ, prompt_len_J, queued)

  def packed():
    q = _decode_queue(
      *args, seed, gamma, temperature, tuning, limit, ctables, first_state_J, **kwargs, mesh=mesh
    )
    j = prompt_JQ.shape[0]
    done = q.rows.replace(
      tokens_BR=q.tokens_JR[:j],
      reveal_step_BR=q.reveal_step_JR[:j],
      nfe_B=q.nfe_J[:j],
      length_B=q.length_J[:j],
      rollbacks_B=q.rollbacks_J[:j],
      cstate_B=q.cstate_J[:j],
      forced_B=q.forced_J[:j],
      acceptance=jax.tree.map(lambda x: x[:j], q.acceptance_J),
    )
    forwards = q.rows.forwards + q.prefills  # B-row forwards and E-row prefills
    return compiled.pack(
      done,
      q.row_forwards_J[:j],
      q.row_wide_forwards_J[:j],
      q.row_ntp_forwards_J[:j],
      forwards,
      q.prefills,
    )

  return compiled.on_mesh(packed, mesh)
