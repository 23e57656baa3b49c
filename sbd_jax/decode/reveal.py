"""What one forward's logits do to the decode state: the SBD reveal (paper Algorithm 3) and
the NTP step, with their accounting.

Accounting. A sequence's NFE counts the forwards it took part in before it was finished
(`loop`), so it equals the forwards it would need decoded alone. A plain SBD sequence is done
once an EOS is revealed with no masked position before it in the block (tokens after it are
dropped), or at its limit (max_new_tokens, or a request's own: `DecodeState.limit_B`); a
verified one once its verified tokens end with an EOS or reach the limit (`verify`).
`reveal_step` holds, per generated token, the sequence's own forward index (1-based) at which
it was revealed (verified: at which it was revealed in the draft that was kept, or corrected).

Dimension letters (docs/dimensions.md): B batch, P block positions, R response slots,
V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.decode import constrained, policy
from sbd_jax.decode.sampling import chosen_logprob, pick_at, pick_rows
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState, row_slices, row_updates
from sbd_jax.sbd import reveal_rules


def sbd_reveal(
  st: DecodeState,
  logits_BPV: jax.Array,
  active_B: jax.Array,
  s: SamplerSettings,
  gamma: jax.Array,
  alone: bool,
) -> DecodeState:
  """Reveal masked positions of each row's block (slots [index, index + P)) and move rows whose
  block is complete (`alone`; else all rows, once every block is) to their next block; plain
  SBD also ends rows here. `st.nfe_B` already counts this forward. A verified decode's narrower
  forward drafts a block of fewer positions (`policy`): P is the logits' width."""
  b, p = logits_BPV.shape[:2]
  eos_id = st.eos_id
  start_B = st.index
  block_BP = row_slices(st.tokens_BR, start_B, p, alone)
  steps_BP = row_slices(st.reveal_step_BR, start_B, p, alone)
  position_P = jnp.arange(p)
  slot_BP = start_B[:, None] + position_P
  in_range_BP = slot_BP < st.limit_B[:, None]
  drafting_B = ~st.done_B & active_B
  # Positions after an EOS already in the block are past the answer: never revealed. (Only a
  # verified block that slid past its draft's EOS holds masks there: `verified_index`.)
  known_eos_B = jnp.min(jnp.where((block_BP == eos_id) & in_range_BP, position_P, p), axis=-1)
  open_BP = (block_BP == s.mask_id) & in_range_BP & drafting_B[:, None]
  open_BP &= position_P <= known_eos_B[:, None]

  # Verified rows' drafts share NTP's noise at their slot; plain rows draw afresh.
  if s.constrained:  # left to right through the block, each position at its state
    unmasked_B = st.verify_B & (not s.forced_tokens)
    sampled_BP, logp_BPV, after_BP = constrained.block_draws(
      st, logits_BPV, slot_BP, block_BP, s, unmasked_B
    )
  else:
    sampled_BP, logp_BPV = pick_rows(logits_BPV, st, slot_BP, s)
  reveal_BP = reveal_rules.get_rule(s.rule)(logp_BPV, open_BP, gamma) & open_BP
  if s.verified and s.draft != "rule":  # verified rows draft every open position, or none
    drafts_BP = open_BP & (s.draft == "all")
    if s.adaptive:
      drafts_BP &= policy.sure_enough(st, logp_BPV, open_BP)
    reveal_BP = jnp.where(st.verify_B[:, None], drafts_BP, reveal_BP)
  if s.settle_eos:
    reveal_BP = reveal_BP | settled_eos(reveal_BP, open_BP, sampled_BP, eos_id)
  if s.constrained:  # each position's mask assumed the draws before it
    reveal_BP = constrained.prefix_only(st, reveal_BP, open_BP)
  block_BP = jnp.where(reveal_BP, sampled_BP, block_BP)
  steps_BP = jnp.where(reveal_BP, st.nfe_B[:, None], steps_BP)
  logprob_BR = st.logprob_BR
  if s.logprobs:
    logprob_BP = row_slices(st.logprob_BR, start_B, p, alone)
    logprob_BP = jnp.where(reveal_BP, chosen_logprob(logp_BPV, sampled_BP), logprob_BP)
    logprob_BR = row_updates(st.logprob_BR, logprob_BP, start_B, alone)

  # The first EOS of the block, p if none, as one plain min-reduction (argmax is a (value,
  # index) reduction, and `any` for "has an EOS" would be another). Each reduction over the
  # block is a kernel of its own at every forward; the EOS bookkeeping below needs two.
  first_eos_B = jnp.min(jnp.where((block_BP == eos_id) & in_range_BP, position_P, p), axis=-1)
  past_BP = position_P > first_eos_B[:, None]
  # Positions still masked before the first EOS (anywhere, without one). The EOS's own
  # position is not among them (it holds the EOS), so these are all the positions left open.
  waiting_B = jnp.any(open_BP & ~reveal_BP & ~past_BP, axis=-1)
  complete_B = drafting_B & ~waiting_B
  ended_B = complete_B & (first_eos_B < p)
  # Positions after the first EOS are past the answer: they hold EOS (what training shows
  # there) and are never decoded, so no forward is spent on them.
  block_BP = jnp.where(past_BP, eos_id, block_BP)
  tokens_BR = row_updates(st.tokens_BR, block_BP, start_B, alone)
  reveal_step_BR = row_updates(st.reveal_step_BR, steps_BP, start_B, alone)
  length_B = jnp.where(ended_B, start_B + first_eos_B + 1, st.length_B)
  done_B = st.done_B | ended_B
  if alone:  # a row finished earlier stays where it is
    advance_B = complete_B
  else:
    advance_B = jnp.broadcast_to(jnp.all(complete_B | st.done_B), (b,))
  index_B = start_B + p * advance_B.astype(jnp.int32)
  cstate_B = st.cstate_B
  if s.constrained:  # a plain row's state moves past a block it completed
    moves_B = advance_B & ~st.verify_B & drafting_B
    cstate_B = jnp.where(moves_B, after_BP[:, -1], cstate_B)
  exhausted_B = index_B >= st.limit_B
  length_B = jnp.where(exhausted_B & ~done_B, st.limit_B, length_B)
  done_B = done_B | exhausted_B
  if s.verified:  # verification ends a verified row (`decode.verify`); the reveal moves it on
    moved_B = jnp.where(drafting_B, verified_index(block_BP, start_B, first_eos_B, st, s), start_B)
    index_B = jnp.where(st.verify_B, moved_B, index_B)
    length_B = jnp.where(st.verify_B, st.length_B, length_B)
    done_B = jnp.where(st.verify_B, st.done_B, done_B)
  return st.replace(
    tokens_BR=tokens_BR,
    logprob_BR=logprob_BR,
    reveal_step_BR=reveal_step_BR,
    length_B=length_B,
    done_B=done_B,
    index=index_B,
    forwards=st.forwards + 1,
    cstate_B=cstate_B,
  )


def verified_index(block_BP, start_B, first_eos_B, st: DecodeState, s: SamplerSettings):
  """Where a verified row's next block starts after a reveal: after the run of revealed tokens
  from the block's start (`check_every_forward`: the next forward checks them, beside a block
  slid past them), or, checked by blocks, after the block once it is complete. Either way the
  draft ends at its EOS or at the row's limit."""
  p = block_BP.shape[1]
  position_P = jnp.arange(p)
  unrevealed_B = start_B + jnp.min(jnp.where(block_BP == s.mask_id, position_P, p), axis=-1)
  end_B = jnp.minimum(start_B + jnp.minimum(first_eos_B + 1, p), st.limit_B)  # the draft's
  if s.check_every_forward:
    return jnp.minimum(unrevealed_B, end_B)
  return jnp.where(unrevealed_B < end_B, start_B, end_B)  # an incomplete block stays


def settled_eos(reveal_BP, open_BP, sampled_BP, eos_id) -> jax.Array:
  """[B, P]: the position to reveal with the rule's when the rule reveals an EOS at q: the first
  of the open positions just before q that all predict EOS (none if q's left neighbour does
  not). Every position after the first EOS is then past the answer, so the positions past it
  settle in this forward instead of one at a time in later ones."""
  p = reveal_BP.shape[-1]
  position_P = jnp.arange(p)
  eos_BP = sampled_BP == eos_id
  q_B = jnp.min(jnp.where(reveal_BP & eos_BP, position_P, p), axis=-1)  # p: no EOS revealed
  breaks_BP = ~(open_BP & eos_BP) & (position_P < q_B[:, None])  # not an open EOS prediction
  run_start_B = jnp.max(jnp.where(breaks_BP, position_P, -1), axis=-1) + 1
  settles_B = (q_B < p) & (run_start_B < q_B)
  return (position_P == run_start_B[:, None]) & settles_B[:, None] & open_BP


def ntp_record(st: DecodeState, logits_BV: jax.Array, s: SamplerSettings) -> DecodeState:
  """Sample token `st.index` (one slot for the batch, or one per row) of unfinished sequences
  from the last position's logits."""
  g = st.index
  slot_B1 = jnp.broadcast_to(jnp.reshape(g, (-1, 1)), (logits_BV.shape[0], 1))
  logits_B1V = logits_BV[:, None]
  if s.constrained:
    logits_B1V = constrained.masked_now(st, logits_B1V)
  token_B1, logp_B1V = pick_at(logits_B1V, st, slot_B1, s)
  token_B = token_B1[:, 0]
  logprob_B = chosen_logprob(logp_B1V, token_B1)[:, 0] if s.logprobs else None
  live_B = ~st.done_B
  nfe_B = st.nfe_B + live_B.astype(jnp.int32)
  if jnp.ndim(g) == 0:
    read = lambda x_BR: jax.lax.dynamic_index_in_dim(x_BR, g, axis=1, keepdims=False)  # noqa: E731
    write = lambda x_BR, new_B: jax.lax.dynamic_update_index_in_dim(x_BR, new_B, g, axis=1)  # noqa: E731
    index = g + 1
  else:  # a finished row stays at its slot (clamped into range once past the last)
    read = lambda x_BR: row_slices(x_BR, g, 1, alone=True)[:, 0]  # noqa: E731
    write = lambda x_BR, new_B: row_updates(x_BR, new_B[:, None], g, alone=True)  # noqa: E731
    index = g + live_B.astype(jnp.int32)
  token_B = jnp.where(live_B, token_B, read(st.tokens_BR))
  step_B = jnp.where(live_B, nfe_B, read(st.reveal_step_BR))
  newly_done_B = live_B & (token_B == st.eos_id)
  length_B = jnp.where(newly_done_B, g + 1, st.length_B)
  exhausted = index >= st.limit_B
  length_B = jnp.where(exhausted & ~(st.done_B | newly_done_B), st.limit_B, length_B)
  logprob_BR = st.logprob_BR
  if s.logprobs:
    logprob_BR = write(logprob_BR, jnp.where(live_B, logprob_B, read(logprob_BR)))
  if s.constrained:
    st = constrained.settle(st, st.cstate_B[:, None], token_B1, live_B[:, None])
  return st.replace(
    tokens_BR=write(st.tokens_BR, token_B),
    logprob_BR=logprob_BR,
    reveal_step_BR=write(st.reveal_step_BR, step_B),
    nfe_B=nfe_B,
    length_B=length_B,
    done_B=st.done_B | newly_done_B | exhausted,
    index=index,
    forwards=st.forwards + 1,
  )
