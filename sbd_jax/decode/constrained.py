"""Constraints inside the decode loop (`SamplerSettings.constraint`): every choice masked to the
tokens a row's token automaton allows where the choice is made (`sbd_jax.constrain`).

Each row holds its automaton's state after its settled tokens (`DecodeState.cstate_B`): a
verified row's verified tokens, a plain SBD row's tokens before its block, NTP's every token.
A row without a constraint holds state 0, which allows every token; rows with different
constraints, or none, share one batch through one table set (`DecodeState.ctables`, traced).

- NTP's choices (NTP's own decode, a verified row's first token, the checks): masked at the
  state before their slot. A check's slots follow the run's drafts, so its states are the
  automaton's walk along them (`run_states`); the row's state then moves past what it settled.
  Masked, NTP's constrained choice is what the check compares a draft with: the text is
  constrained NTP's, token for token.
- Drafts and reveals (`block_draws`): left to right through the block, each position masked at
  the state its earlier positions lead to (their tokens, or the ones drawn for them here), with
  the noise the unconstrained draw would use (Gumbel-max: the same noise argmax'd over the
  allowed tokens). A position's mask assumes the positions before it take their drawn tokens,
  so only a prefix of the block is revealed (`prefix_only`). A state that allows one token
  draws it: a forced token is drafted, and settled by the next check without the model's say
  (`SamplerSettings.forced_tokens`; off, verified rows draft as if unconstrained and only the
  checks are masked).

Where no row of the batch holds a constraint, each of these skips the automaton's work
(`lax.cond` on `any_row`): state 0 allows every token and leads back to itself, so the work
would change nothing, and a constrained program (a server's pools, `structured_output`) then
decodes unconstrained requests at the unconstrained program's cost.

Dimension letters (docs/dimensions.md): B batch, T positions, P block positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.constrain import device as automaton
from sbd_jax.constrain import tables
from sbd_jax.decode import sampling
from sbd_jax.decode.settings import SamplerSettings


def any_row(st) -> jax.Array:
  """bool []: whether some row holds a constraint (a state other than UNCONSTRAINED)."""
  return jnp.any(st.cstate_B != tables.UNCONSTRAINED)


def masked(st, logits_BTV: jax.Array, state_BT: jax.Array) -> jax.Array:
  """The logits with what each position's state does not allow at -inf."""
  return automaton.mask_logits(st.ctables, logits_BTV, state_BT)


def masked_now(st, logits_B1V: jax.Array) -> jax.Array:
  """NTP's logits for each row's next token, masked at its state (`cstate_B`)."""
  return jax.lax.cond(
    any_row(st), lambda: masked(st, logits_B1V, st.cstate_B[:, None]), lambda: logits_B1V
  )


def checked(st, logits_BPV: jax.Array, token_BP: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A check's NTP logits masked at the states the run's tokens `token_BP` lead to
  (`run_states`), and those states [B, P]."""

  def walk():
    state_BP = run_states(st, token_BP)
    return masked(st, logits_BPV, state_BP), state_BP

  unconstrained = lambda: (logits_BPV, jnp.zeros(token_BP.shape, jnp.int32))  # noqa: E731
  return jax.lax.cond(any_row(st), walk, unconstrained)


def settle(st, state_BT: jax.Array, token_BT: jax.Array, settles_BT: jax.Array):
  """The state with each row moved past its settled tokens (`settles_BT`, a prefix of
  `token_BT`, decided at `state_BT`), and the forced ones among them counted (`forced_B`)."""

  def move():
    settled_B = jnp.sum(settles_BT, axis=-1)
    forced_B = st.forced_B + jnp.sum(settles_BT & forced(st, state_BT), axis=-1)
    live_B = jnp.any(settles_BT, axis=-1)
    return moved(st, state_BT, token_BT, settled_B, live_B), forced_B.astype(jnp.int32)

  cstate_B, forced_B = jax.lax.cond(any_row(st), move, lambda: (st.cstate_B, st.forced_B))
  return st.replace(cstate_B=cstate_B, forced_B=forced_B)


def run_states(st, token_BT: jax.Array) -> jax.Array:
  """[B, T]: the state before each slot of a run that starts after the row's settled tokens
  (`cstate_B`), the slots' tokens being `token_BT` (the state before slot t follows the tokens
  at slots < t)."""
  after_BT = automaton.advance(st.ctables, st.cstate_B, token_BT)
  return automaton.states_before(st.cstate_B, after_BT)


def moved(st, state_BT: jax.Array, token_BT: jax.Array, settled_B: jax.Array, rows_B) -> jax.Array:
  """[B]: the rows' states after settling the first `settled_B` of `token_BT`, decided at
  `state_BT` (rows outside `rows_B`, and rows that settled none, keep theirs)."""
  after_BT = automaton.next_state(st.ctables, state_BT, token_BT)
  last_B1 = jnp.maximum(settled_B - 1, 0)[:, None]
  after_B = jnp.take_along_axis(after_BT, last_B1, axis=1)[:, 0]
  return jnp.where(rows_B & (settled_B > 0), after_B, st.cstate_B)


def forced(st, state_BT: jax.Array) -> jax.Array:
  """bool: the states that allow one token only (not EOS)."""
  return automaton.forced_token(st.ctables, state_BT) >= 0


def block_draws(st, logits_BPV, slot_BP, block_BP, s: SamplerSettings, unmasked_B):
  """A block's draws under each row's constraint, left to right (module docstring). Returns
  (tokens [B, P], log-probabilities [B, P, V] of the masked, scaled logits, and the state
  after each position [B, P]). `unmasked_B`: rows that draw as if unconstrained. With no
  constraint in the batch: `sampling.pick_rows`' draws (the same: Gumbel-max with one noise)."""

  def unconstrained():
    tokens_BP, logp_BPV = sampling.pick_rows(logits_BPV, st, slot_BP, s)
    return tokens_BP, logp_BPV, jnp.zeros(block_BP.shape, jnp.int32)

  return jax.lax.cond(
    any_row(st),
    lambda: _left_to_right(st, logits_BPV, slot_BP, block_BP, s, unmasked_B),
    unconstrained,
  )


def _left_to_right(st, logits_BPV, slot_BP, block_BP, s: SamplerSettings, unmasked_B):
  b, p = block_BP.shape
  scaled_BPV = sampling.scaled_logits(logits_BPV, s, st.temperature_B)
  noise_BPV = sampling.noise(scaled_BPV, st, slot_BP, s)
  known_B = jnp.where(st.verify_B, st.verified_B, st.index)  # cstate_B is after these
  state_B = st.cstate_B
  tokens, logps, afters = [], [], []
  for j in range(p):
    at_known_B = slot_BP[:, j] == known_B
    state_B = jnp.where(at_known_B, st.cstate_B, state_B)
    free_B = unmasked_B | (slot_BP[:, j] < known_B)  # settled already, or drawn unmasked
    logits_BV = jnp.where(
      free_B[:, None],
      scaled_BPV[:, j],
      masked(st, scaled_BPV[:, j][:, None], state_B[:, None])[:, 0],
    )
    drawn_B = sampling.argmax(logits_BV + noise_BPV[:, j])
    token_B = jnp.where(block_BP[:, j] == s.mask_id, drawn_B, block_BP[:, j])
    state_B = automaton.next_state(st.ctables, state_B, token_B)
    tokens.append(drawn_B)
    logps.append(jax.nn.log_softmax(logits_BV, axis=-1))
    afters.append(state_B)
  return jnp.stack(tokens, 1), jnp.stack(logps, 1), jnp.stack(afters, 1)


def prefix_only(st, reveal_BP: jax.Array, open_BP: jax.Array) -> jax.Array:
  """`reveal_BP` cut, in constrained rows, to the open positions before the first open one left
  masked (a position's mask assumed the tokens drawn before it), and the first open position
  revealed where the cut leaves none: every forward still reveals a token. (A row without a
  constraint reveals as it would unconstrained.)"""
  constrained_B1 = (st.cstate_B != tables.UNCONSTRAINED)[:, None]
  first_BP = (jnp.cumsum(open_BP, axis=1) == 1) & open_BP
  reveal_BP |= first_BP & jnp.any(reveal_BP, axis=1, keepdims=True) & constrained_B1
  skipped_BP = jnp.cumsum(open_BP & ~reveal_BP, axis=1) > 0
  return reveal_BP & ~(skipped_BP & constrained_B1)
