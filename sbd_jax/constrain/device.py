"""Constraint primitives on device: pure, jit-friendly functions of `ConstraintTables`.

A state is an int32 global state of the tables (`tables`: 0 unconstrained, 1 dead). Every
function takes states of any shape and works elementwise; the names say the decode's shapes.
The next state of (state, token) is a bit test, then a binary search of the state's moves with
a fixed number of steps (ceil(log2(V + 1)) at most, fewer when M is smaller), so no [A, V]
table exists anywhere.

Dimension letters (docs/dimensions.md): B batch, T positions, V vocabulary, A automaton
states, U uint32 words of a vocabulary bitmask, M moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.constrain.tables import DEAD, ConstraintTables


def allowed_mask(tables: ConstraintTables, state_BT: jax.Array, vocab_size: int) -> jax.Array:
  """bool [..., V]: the tokens each state allows."""
  u = tables.allowed_AU.shape[-1]
  if not 32 * (u - 1) < vocab_size <= 32 * u:
    raise ValueError(
      f"tables of {u} words cover {32 * (u - 1) + 1}..{32 * u} tokens, not {vocab_size}"
    )
  words_BTU = jnp.asarray(tables.allowed_AU)[state_BT]
  bits_BTU32 = (words_BTU[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  return bits_BTU32.reshape(*state_BT.shape, 32 * u)[..., :vocab_size].astype(bool)


def mask_logits(tables: ConstraintTables, logits_BTV: jax.Array, state_BT: jax.Array) -> jax.Array:
  """The logits with every token the position's state does not allow at -inf. A dead state
  allows nothing: its row is all -inf."""
  allowed_BTV = allowed_mask(tables, state_BT, logits_BTV.shape[-1])
  return jnp.where(allowed_BTV, logits_BTV, -jnp.inf)


def allows(tables: ConstraintTables, state_BT: jax.Array, token_BT: jax.Array) -> jax.Array:
  """bool: whether each state allows its token (ids outside the tables: no)."""
  u = tables.allowed_AU.shape[-1]
  inside = (token_BT >= 0) & (token_BT < 32 * u)
  token = jnp.where(inside, token_BT, 0).astype(jnp.uint32)
  word_BT = jnp.asarray(tables.allowed_AU)[state_BT, (token >> 5).astype(jnp.int32)]
  return inside & (((word_BT >> (token & 31)) & 1) == 1)


def _search_steps(tables: ConstraintTables) -> int:
  """Binary-search steps that cover any state's moves (at most M, and fewer than V)."""
  longest = min(tables.move_token_M.shape[0], 32 * tables.allowed_AU.shape[-1])
  return max(1, longest.bit_length())


def next_state(tables: ConstraintTables, state_BT: jax.Array, token_BT: jax.Array) -> jax.Array:
  """int32: the state after each token; DEAD where the state does not allow it."""
  state_BT, token_BT = jnp.asarray(state_BT, jnp.int32), jnp.asarray(token_BT, jnp.int32)
  move_token_M = jnp.asarray(tables.move_token_M)
  start_BT = jnp.asarray(tables.move_start_A)[state_BT]
  end_BT = start_BT + jnp.asarray(tables.move_count_A)[state_BT]

  def step(_, bounds):  # the first move in [low, high) whose token is >= the token
    low, high = bounds
    mid = (low + high) // 2
    right = move_token_M[jnp.minimum(mid, move_token_M.shape[0] - 1)] < token_BT
    open_ = low < high
    return jnp.where(open_ & right, mid + 1, low), jnp.where(open_ & ~right, mid, high)

  low, _ = jax.lax.fori_loop(0, _search_steps(tables), step, (start_BT, end_BT))
  at = jnp.minimum(low, move_token_M.shape[0] - 1)
  found = (low < end_BT) & (move_token_M[at] == token_BT)
  nxt = jnp.where(
    found, jnp.asarray(tables.move_next_M)[at], jnp.asarray(tables.default_A)[state_BT]
  )
  return jnp.where(allows(tables, state_BT, token_BT), nxt, DEAD).astype(jnp.int32)


def advance(tables: ConstraintTables, state_B: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """int32 [B, T]: each row's state after each of its tokens, from `state_B` (the state before
  position t is `state_B` for t = 0, else the result at t - 1). A token its state does not
  allow leads to DEAD, and DEAD stays."""

  def one(state_B, token_B):
    nxt = next_state(tables, state_B, token_B)
    return nxt, nxt

  _, states_TB = jax.lax.scan(one, jnp.asarray(state_B, jnp.int32), jnp.swapaxes(tokens_BT, 0, 1))
  return jnp.swapaxes(states_TB, 0, 1)


def states_before(state_B: jax.Array, after_BT: jax.Array) -> jax.Array:
  """int32 [B, T]: the state each position is decided in, from `advance`'s states after."""
  return jnp.concatenate([jnp.asarray(state_B, jnp.int32)[:, None], after_BT[:, :-1]], axis=1)


def is_final(tables: ConstraintTables, state_BT: jax.Array) -> jax.Array:
  """bool: the text so far is complete, and EOS is allowed (UNCONSTRAINED: always)."""
  return jnp.asarray(tables.final_A)[state_BT]


def forced_token(tables: ConstraintTables, state_BT: jax.Array) -> jax.Array:
  """int32: the one token the state allows (EOS not allowed), or -1."""
  return jnp.asarray(tables.forced_A)[state_BT]


def is_dead(state_BT: jax.Array) -> jax.Array:
  return state_BT == DEAD
