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

Dimension letters (docs/dimensions.md): B batch, T positions, P block positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.constrain import device as automaton
from sbd_jax.constrain import tables
from sbd_jax.decode import sampling
from sbd_jax.decode.settings import SamplerSettings


def masked(st, logits_BTV: jax.Array, state_BT: jax.Array) -> jax.Array:
  """The logits with what each position's state does not allow at -inf."""
  return automaton.mask_logits(st.ctables, logits_BTV, state_BT)


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
  after each position [B, P]). `unmasked_B`: rows that draw as if unconstrained."""
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
