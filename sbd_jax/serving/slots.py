"""Fixed-shape decode rows that stay on device between calls: the device half of a server.

`init` allocates B empty rows (a KV cache of S slots each). `admit` prefills one prompt into a
free row: its own γ, temperature, token limit, verification (in settings that can verify) and
sampling key (`state.prompt_keys(seed, index)`, the key `sample` gives prompt `index` of its
list). `advance` runs every busy row a bounded number of forwards, frees the rows it is
told to evict first, and returns a small host view of every row, with the forwards each row had
run when each of its tokens settled (`Slots.settled_at_BR`). Rows move through their SBD
blocks alone, or keep a token slot each (NTP), so a row decodes exactly as `sampler.decode`
decodes its prompt alone, whatever its neighbours do (a verified row's text; its forwards too
unless it pauses its drafts or the pool runs NTP's forwards: `loop`; the refill queue's argument,
`decode.queue`). A row's cache holds its prompt left-padded to its own bucket Q.

Constrained settings (`SamplerSettings.constraint`): each row holds its automaton state
(`DecodeState.cstate_B`; 0 unconstrained), and `admit` and `advance` take the pool's table set
as a traced argument (`pool_tables`: every call the same shapes), so rows with different
constraints, and none, share the slots; the slots keep no tables between calls. `advance`
first moves the rows' states by what the pool's repacking moved their automata, and its view
says whether each row's automaton accepts its tokens (`complete_B`) and how many of them were
forced.

Compilations: `init` and `advance` once per settings, `admit` once per prompt bucket.

Dimension letters (docs/dimensions.md): B rows, Q prompt slots, R response slots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax import sharding
from sbd_jax.constrain import device as automaton
from sbd_jax.constrain import tables
from sbd_jax.decode import compiled, loop, queue
from sbd_jax.decode.acceptance import Acceptance
from sbd_jax.decode.compiled import StaticGraph
from sbd_jax.decode.state import DecodeState, RowLayout, initial_state, prompt_keys
from sbd_jax.model.kv_cache import KVCache

_SHAPES = ("settings", "model_cfg", "cache_length", "mesh")
_STATIC = ("graph", *_SHAPES)


@flax.struct.dataclass
class Slots:
  """The rows' decode and where each row's tokens sit, with each row's γ."""

  rows: DecodeState
  layout: RowLayout
  gamma_B: jax.Array  # float32
  # The row's forwards (its NFE) when each token settled (`settled`); 0 before it has.
  settled_at_BR: jax.Array  # int32


class RowView(NamedTuple):
  """What the host reads after `advance`, a row per slot."""

  tokens_BR: np.ndarray
  settled_at_BR: np.ndarray  # the row's forwards when each token settled
  settled_B: np.ndarray  # leading tokens that will not change (`settled`)
  done_B: np.ndarray
  nfe_B: np.ndarray
  rollbacks_B: np.ndarray  # verified rows: drafts rejected so far
  acceptance: Acceptance  # verified rows: drafts and accepted tokens so far (numpy leaves)
  # Constrained pools: the row's automaton accepts its tokens so far (always, unconstrained),
  # and the tokens it settled at a state that allowed one token only
  complete_B: np.ndarray
  forced_B: np.ndarray
  forwards: int  # forwards the rows have run since `init`, prefills not included
  wide_forwards: int  # of those, 2P-token forwards (a block's first pass after a block)
  logprob_BR: np.ndarray  # float32: each token's log-probability (`DecodeState.logprob_BR`)


def settled(st: DecodeState) -> jax.Array:
  """Leading tokens of each row that no later forward changes: its complete blocks (SBD), its
  verified tokens (verified SBD) or its sampled tokens (NTP); once done, the tokens it keeps."""
  taken_B = jnp.where(st.verify_B, st.verified_B, st.index)
  return jnp.where(st.done_B, st.length_B, jnp.minimum(taken_B, st.limit_B))


def _in_mesh(compute, mesh):
  if mesh is None:
    return compute()
  with sharding.activation_sharding(mesh):
    return compute()


@functools.partial(jax.jit, static_argnames=(*_SHAPES, "rows"))
def init(*, rows: int, settings, model_cfg, cache_length, mesh) -> Slots:
  """`rows` free rows (done, holding nothing) over caches of `cache_length` slots."""
  compiled.count_compilation()
  s = settings

  def compute():
    cache = KVCache.empty(model_cfg, rows, cache_length, heads_first=loop.platform(mesh) == "tpu")
    cache = cache.replace(end=jnp.zeros((rows,), jnp.int32))
    keys_B = prompt_keys(jnp.uint32(0), jnp.zeros((rows,), jnp.int32))
    st = initial_state(s, cache, keys_B, jnp.ones((rows,), bool), row_index=True)
    layout = RowLayout.of(jnp.ones((rows,), jnp.int32), s.response_slots)
    zeros_BR = jnp.zeros((rows, s.response_slots), jnp.int32)
    return Slots(
      rows=st, layout=layout, gamma_B=jnp.zeros((rows,), jnp.float32), settled_at_BR=zeros_BR
    )

  return _in_mesh(compute, mesh)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("slots",))
def admit(
  graph: StaticGraph,
  weights: list,
  slots: Slots,
  row,
  prompt_1Q,
  prompt_len_1,
  seed,
  index,
  limit,
  gamma,
  temperature,
  verify,
  ctables=None,
  cstate=0,
  *,
  settings,
  model_cfg,
  cache_length,
  mesh,
) -> Slots:
  """`slots` with row `row` holding the left-padded prompt `prompt_1Q` after its prefill (the
  first forward: NTP's first token, SBD's first pass of block 0), allowed `limit` tokens (at
  most the settings' max_new_tokens, which the row's slots hold), sampling at `temperature` when
  the settings sample (0: greedy), its drafts checked against NTP when `verify` (a traced
  bool) and the settings can verify (`SamplerSettings.verified`). Constrained settings: the
  row starts at automaton state `cstate` (int32; 0 unconstrained) of the table set `ctables`
  (traced, the pool's shapes)."""
  compiled.count_compilation()
  s = settings

  def compute():
    forward = functools.partial(loop.model_forward, graph.graphdef, graph.state(weights), mesh=mesh)
    cache_1 = KVCache.empty(model_cfg, 1, cache_length, heads_first=loop.platform(mesh) == "tpu")
    key_1 = prompt_keys(seed, jnp.reshape(index, (1,)).astype(jnp.int32))
    temperature_1 = jnp.reshape(temperature, (1,))
    verify_1 = jnp.reshape(verify, (1,))
    # The pool's tuning as of its last call: the prefill's shape is the policy's (`loop.prefill`).
    new = initial_state(
      s, cache_1, key_1, jnp.zeros((1,), bool), True, temperature_1, verify_1,
      tuning=slots.rows.tuning, ctables=ctables, cstate=jnp.reshape(cstate, (1,)),
    )  # fmt: skip
    # A row never generates past its response slots, whatever the caller asks for.
    limit_1 = jnp.minimum(jnp.reshape(limit, (1,)).astype(jnp.int32), s.max_new_tokens)
    new = new.replace(limit_B=limit_1)
    layout_1 = RowLayout.of(prompt_len_1, s.response_slots)
    gamma_1 = jnp.reshape(gamma, (1,)).astype(jnp.float32)
    active_1 = jnp.ones((1,), bool)
    new = loop.prefill(new, prompt_1Q, layout_1, forward, s, gamma_1[:, None], active_1, True)
    rows_1 = jnp.reshape(row, (1,)).astype(jnp.int32)
    put = lambda x_B, x_1: queue.put_rows(x_B, rows_1, x_1)  # noqa: E731
    return slots.replace(
      rows=queue.put_state(slots.rows, rows_1, new),
      layout=jax.tree.map(put, slots.layout, layout_1),
      gamma_B=put(slots.gamma_B, gamma_1),
      settled_at_BR=put(slots.settled_at_BR, _settle(new, jnp.zeros_like(new.tokens_BR), 0)),
    )

  return _in_mesh(compute, mesh)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "forwards"), donate_argnames=("slots",))
def advance(
  graph: StaticGraph,
  weights: list,
  slots: Slots,
  evict_B,
  stop_at_done,
  tuning,
  ctables=None,
  cshift_B=None,
  *,
  forwards: int,
  settings,
  model_cfg,
  cache_length,
  mesh,
) -> tuple[Slots, jax.Array]:
  """Free the rows in `evict_B`, then run forwards of every busy row until `forwards` have
  run, every row is done, or (`stop_at_done`, a traced bool: requests are waiting) a row has
  finished. Runs one forward per step of an outer loop, which records when each token settles.
  `tuning` (`policy.Tuning`, traced): how a verified pool chooses its forwards; forced to one
  kind, no row ends at an EOS (`costs`). Constrained settings: `ctables`, the pool's table
  set (traced), and `cshift_B` (int32 [B]), what each row's automaton states move by since the
  tables were repacked (`pool_tables`). Returns the slots and `RowView`'s columns packed as
  int32 [B, 3R + 3P + 11] (the log-probabilities' float32 bits)."""
  compiled.count_compilation()
  s = settings
  b = evict_B.shape[0]

  def compute():
    forward = functools.partial(loop.model_forward, graph.graphdef, graph.state(weights), mesh=mesh)
    eos_id = jnp.where(tuning.force >= 0, -1, s.eos_id).astype(jnp.int32)
    st = slots.rows.replace(done_B=slots.rows.done_B | evict_B, tuning=tuning, eos_id=eos_id)
    complete_B = jnp.ones((b,), bool)
    if ctables is not None:
      st = st.replace(ctables=ctables, cstate_B=_shifted(st.cstate_B, cshift_B))
    done_before_B, start = st.done_B, st.forwards

    def go(st: DecodeState) -> jax.Array:
      finished = jnp.any(st.done_B & ~done_before_B)
      return ~jnp.all(st.done_B) & (st.forwards - start < forwards) & ~(stop_at_done & finished)

    alone = s.rows_move_alone(b)
    gamma_B1 = slots.gamma_B[:, None]
    active_B = jnp.ones((b,), bool)

    def one_forward(carry):
      st, settled_at_BR = carry
      before_B, began = settled(st), st.forwards
      once = lambda st: go(st) & (st.forwards == began)  # noqa: E731
      st = loop.decode_while(st, slots.layout, forward, s, gamma_B1, active_B, alone, once)
      return st, _settle(st, settled_at_BR, before_B)

    carry = (st, slots.settled_at_BR)
    st, settled_at_BR = jax.lax.while_loop(lambda c: go(c[0]), one_forward, carry)
    a = st.acceptance
    if ctables is not None:
      complete_B = automaton.is_final(ctables, st.cstate_B)
    columns = [
      st.tokens_BR,
      settled_at_BR,
      settled(st)[:, None],
      st.done_B[:, None],
      st.nfe_B[:, None],
      st.rollbacks_B[:, None],
      jnp.stack([complete_B, st.forced_B], axis=1),
      a.packed(),
      jnp.broadcast_to(st.forwards, (b, 1)),
      jnp.broadcast_to(st.wide_forwards, (b, 1)),
      jax.lax.bitcast_convert_type(st.logprob_BR, jnp.int32),
    ]
    view = jnp.concatenate([c.astype(jnp.int32) for c in columns], axis=1)
    if mesh is not None:
      view = jax.lax.with_sharding_constraint(view, sharding.replicated(mesh))
    return slots.replace(rows=st.replace(ctables=None), settled_at_BR=settled_at_BR), view

  return _in_mesh(compute, mesh)


def _settle(st: DecodeState, settled_at_BR: jax.Array, before_B) -> jax.Array:
  """`settled_at_BR` with the tokens settled since `before_B` stamped with their row's
  forwards."""
  r_R = jnp.arange(settled_at_BR.shape[1])
  new_BR = (r_R >= jnp.reshape(before_B, (-1, 1))) & (r_R < settled(st)[:, None])
  return jnp.where(new_BR, st.nfe_B[:, None], settled_at_BR)


def _shifted(cstate_B: jax.Array, cshift_B) -> jax.Array:
  """The rows' automaton states moved by `cshift_B` (None: not moved); the reserved states
  (unconstrained, dead) stay."""
  if cshift_B is None:
    return cstate_B
  return jnp.where(cstate_B >= tables.RESERVED_STATES, cstate_B + cshift_B, cstate_B)


def unpack(view_BX: np.ndarray, response_slots: int) -> RowView:
  """`advance`'s packed view [B, 3R + 3P + 11] as a `RowView`."""
  r = response_slots
  p = (view_BX.shape[1] - 3 * r - 11) // 3
  column = lambda i: view_BX[:, 2 * r + i]  # noqa: E731
  at = 2 * r + 6  # after the per-row columns: the acceptance counts
  acceptance = Acceptance.unpacked(view_BX[:, at : at + 3 + 3 * p])
  at += 3 + 3 * p  # the batch's forwards, then the log-probabilities
  logprob_BR = np.ascontiguousarray(view_BX[:, at + 2 :]).view(np.float32)
  return RowView(
    tokens_BR=view_BX[:, :r],
    settled_at_BR=view_BX[:, r : 2 * r],
    settled_B=column(0),
    done_B=column(1).astype(bool),
    nfe_B=column(2),
    rollbacks_B=column(3),
    acceptance=acceptance,
    complete_B=column(4).astype(bool),
    forced_B=column(5),
    forwards=int(view_BX[0, at]),
    wide_forwards=int(view_BX[0, at + 1]),
    logprob_BR=logprob_BR,
  )
