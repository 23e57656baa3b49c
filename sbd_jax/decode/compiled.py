"""The decode as a compiled program: weights as an argument (`StaticGraph`), one packed
int32 result per call (`pack` / `unpack`), the mesh's activation sharding, and a count of the
compilations.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax import sharding
from sbd_jax.constrain import device as automaton
from sbd_jax.decode.acceptance import Acceptance
from sbd_jax.decode.loop import decode_rows
from sbd_jax.decode.state import DecodeState, prompt_keys

_TRACES = [0]


@dataclasses.dataclass(frozen=True, eq=False)
class StaticGraph:
  """A model's structure (nnx GraphDef and the weights' treedef) as a jit static argument,
  hashed once rather than on every call: jit hashes static arguments per call, and a GraphDef
  hashes node by node, a cost that grows with the layers. The weights then travel as a flat
  list of arrays, which jit flattens in C++, where an nnx.State argument would be flattened in
  Python at every call."""

  graphdef: Any
  treedef: Any

  @classmethod
  def of(cls, graphdef, state) -> "StaticGraph":
    return cls(graphdef, jax.tree.structure(state))

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash((self.graphdef, self.treedef)))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, StaticGraph):
      return False
    same = lambda a, b: a is b or a == b  # noqa: E731
    return same(other.graphdef, self.graphdef) and same(other.treedef, self.treedef)

  def state(self, weights: list) -> Any:
    """The nnx.State whose leaves are `weights` (in `jax.tree.leaves` order)."""
    return jax.tree.unflatten(self.treedef, weights)


class BatchResult(NamedTuple):
  """One decode call's results on the host (`unpack`), a row per prompt."""

  tokens_BR: np.ndarray
  reveal_step_BR: np.ndarray
  nfe_B: np.ndarray
  length_B: np.ndarray
  # Forwards spent on the prompt's row while it held the prompt (its prefill included; in a
  # batch, all of the batch's forwards): >= the prompt's NFE. And of them the 2P-token ones.
  row_forwards_B: np.ndarray
  row_wide_forwards_B: np.ndarray
  row_ntp_forwards_B: np.ndarray  # of them, verified SBD's NTP one-token forwards
  rollbacks_B: np.ndarray  # verified decoding: drafts rejected
  acceptance: Acceptance  # verified decoding: drafts and accepted tokens (numpy leaves)
  forwards: int  # every forward of the call, its prefills included
  wide_forwards: int  # of them, SBD's 2P-token forwards
  ntp_forwards: int  # of them, verified SBD's NTP one-token forwards
  prefills: int  # of them, prompt forwards: one per batch, or one per prompt of a queue
  kind_forwards: np.ndarray  # [K] the call's forwards by kind (`DecodeState.kind_forwards_K`)
  # Constrained decodes: tokens settled at a state that allowed one token only, and whether
  # the text is complete (its automaton accepts it; always, unconstrained)
  forced_B: np.ndarray
  complete_B: np.ndarray


_TOTALS = 4  # forwards, wide forwards, NTP forwards, prefills: the last columns


def pack(st: DecodeState, row_forwards_B, row_wide_B, row_ntp_B, forwards, prefills) -> jax.Array:
  """A decode's results as one int32 array [B, 2R + 3P + K + 15] (see `unpack`): one transfer to
  the host, not a dozen. `st` gives the tokens, reveal steps, NFE, lengths, acceptance and the
  wide, NTP and each kind's forwards; `row_*_B` count each row's forwards, its wide and its NTP ones;
  `forwards` counts every forward of the call, `prefills` of them the prompt forwards."""
  b = len(st.nfe_B)
  a = st.acceptance
  totals = [jnp.asarray(forwards), st.wide_forwards, st.ntp_forwards, jnp.asarray(prefills)]
  totals = jnp.stack(totals)
  per_row = [st.nfe_B, st.length_B, row_forwards_B, row_wide_B, st.rollbacks_B, row_ntp_B]
  complete_B = jnp.ones(b, bool)
  if st.ctables is not None:
    complete_B = automaton.is_final(st.ctables, st.cstate_B)
  per_row += [st.forced_B, complete_B]
  columns = [st.tokens_BR, st.reveal_step_BR, jnp.stack(per_row, axis=1), a.packed()]
  columns += [st.kind_forwards_K[None], totals[None]]
  return jnp.concatenate(
    [jnp.broadcast_to(c, (b, c.shape[1])).astype(jnp.int32) for c in columns], axis=1
  )


def unpack(packed_BX: np.ndarray, response_slots: int, block_size: int) -> BatchResult:
  """`pack`'s array [B, 2R + 3P + K + 15] as a `BatchResult`."""
  r, p = response_slots, block_size
  column = lambda i: packed_BX[:, 2 * r + i]  # noqa: E731
  total = lambda i: int(packed_BX[0, i - _TOTALS])  # noqa: E731
  at = 2 * r + 8  # after the per-row columns: the acceptance counts, then the kinds
  acceptance = Acceptance.unpacked(packed_BX[:, at : at + 3 + 3 * p])
  at += 3 + 3 * p
  return BatchResult(
    tokens_BR=packed_BX[:, :r],
    reveal_step_BR=packed_BX[:, r : 2 * r],
    nfe_B=column(0),
    length_B=column(1),
    row_forwards_B=column(2),
    row_wide_forwards_B=column(3),
    rollbacks_B=column(4),
    row_ntp_forwards_B=column(5),
    acceptance=acceptance,
    forwards=total(0),
    wide_forwards=total(1),
    ntp_forwards=total(2),
    prefills=total(3),
    kind_forwards=packed_BX[0, at:-_TOTALS],
    forced_B=column(6),
    complete_B=column(7).astype(bool),
  )


@functools.partial(
  jax.jit, static_argnames=("graph", "settings", "model_cfg", "cache_length", "mesh")
)
def decode_batch(
  graph: StaticGraph,
  weights: list,
  prompt_BQ,
  prompt_len_B,
  active_B,
  seed,
  batch_index,
  gamma,
  temperature,
  tuning,
  limit,
  ctables=None,
  cstate_B=None,
  *,
  settings,
  model_cfg,
  cache_length,
  mesh,
):
  """`decode_rows` compiled per (shapes, settings without γ and temperature: they are traced
  float32 scalars; `settings.with_traced_values`). The tuning of a verified decode's forwards
  (`policy.Tuning`), the rows' token limit (int32, at most `settings.max_new_tokens`), and a
  constrained decode's automaton tables and rows' initial states (`decode.constrained`) are
  traced too.
  `batch_index` is the index of the batch's first prompt among all prompts decoded: row b
  draws with `prompt_keys(seed, batch_index + b)`, made on device (no host dispatch).
  Returns `pack`'s one int32 array [B, 2R + 3P + K + 15].
  With a mesh, it comes back replicated on every device."""
  count_compilation()
  key_B = prompt_keys(seed, batch_index + jnp.arange(prompt_BQ.shape[0], dtype=jnp.int32))
  kwargs = dict(settings=settings, model_cfg=model_cfg, cache_length=cache_length, mesh=mesh)
  args = (graph.graphdef, graph.state(weights), prompt_BQ, prompt_len_B, active_B, key_B, gamma)
  kwargs.update(temperature=temperature, tuning=tuning, limit=limit, ctables=ctables)
  kwargs["cstate"] = 0 if cstate_B is None else cstate_B

  def packed():
    st = decode_rows(*args, **kwargs)
    b = len(st.nfe_B)
    each_row = lambda x: jnp.broadcast_to(x, (b,))  # noqa: E731
    counts = (each_row(st.forwards), each_row(st.wide_forwards), each_row(st.ntp_forwards))
    return pack(st, *counts, st.forwards, 1)

  return on_mesh(packed, mesh)


def on_mesh(compute, mesh):
  """`compute()` traced with the mesh's activation sharding, its (small) result replicated on
  every device, so that each process can read it when the mesh spans hosts (a row-sharded
  result is not addressable from one process). Without a mesh, `compute()`."""
  if mesh is None:
    return compute()
  with sharding.activation_sharding(mesh):
    out = compute()
  return jax.lax.with_sharding_constraint(out, sharding.replicated(mesh))


def count_compilation() -> None:
  """Called from a jitted decode's body: it runs once per trace, i.e. per compilation."""
  _TRACES[0] += 1


def compiled_count() -> int:
  """How many (shape, settings) variants of the decode have been traced (= compiled) here."""
  return _TRACES[0]
