"""Verified SBD: every drafted token checked against NTP's own choice, so the text is NTP's.

The first pass of a block is the wide forward [the tokens decided since the cache's end,
causal ; the block] (`loop`). Its causal half computes what NTP would: the logits at slot t
give NTP's token for slot t + 1. Those check the draft in the causal half, as speculative
decoding checks a drafter's tokens, with the model as its own drafter and no extra forward:

- Every drafted token equals NTP's: the causal half is committed to the cache, and the last
  causal logits give NTP's token for the block's first slot, which is set there at once (the
  block's first token is never a guess).
- At the first disagreement, slot r: slots before r are kept, and NTP's token is set at r. The
  cache keeps the keys and values of the slots before r only (those of r and after came from
  the rejected tokens), this forward's block is discarded, and the next block starts at r + 1.
  Its first pass is wide again: [the token at r ; the block].

So the cache only ever holds a causal forward's keys and values of NTP's text, and a row ends
when its verified tokens end with an EOS or reach its limit: a draft that ends costs one more
forward, whose causal half checks it.

With a temperature, NTP's token at slot r is the Gumbel-max draw with noise fixed by (the row's
key, r), and the drafter draws slot r with the same noise (`sampling.pick_at`): a draft that
agrees is accepted, so the text is NTP's sample for that seed, token for token.

Verification is a row's own setting (`DecodeState.verify_B`): in a program that can verify, a
row that does not is plain SBD, token for token: its causal tokens are committed unchecked,
its blocks start with a mask, it ends at its own reveal, and it draws with plain SBD's noise.

Dimension letters (docs/dimensions.md): B batch, P block positions, R response slots,
V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.decode.sampling import chosen_logprob, pick_at
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState, scatter_slots


def check_drafts(
  st: DecodeState, causal_logits_BPV: jax.Array, causal_B: jax.Array, s: SamplerSettings
) -> tuple[DecodeState, jax.Array]:
  """Check each row's `causal_B` tokens from slot `commit` against NTP's choices from
  `causal_logits_BPV` (the logits at those slots; `causal_B` = 0: nothing to check), and commit
  or roll back (module docstring). `st.cache` holds this forward's writes from its end, which
  moves past the accepted slots only; `st.nfe_B` already counts this forward.
  Returns the state and which rows were rolled back (their block logits are stale)."""
  b, p = causal_logits_BPV.shape[:2]
  r_slots = st.tokens_BR.shape[1]
  t_P = jnp.arange(p)
  slot_BP = st.commit_B[:, None] + t_P  # the causal tokens' slots
  choice_BP, logp_BPV = pick_at(causal_logits_BPV, st, slot_BP + 1, s)  # NTP's, for slot + 1
  draft_BP = jnp.take_along_axis(st.tokens_BR, jnp.minimum(slot_BP, r_slots - 1), axis=1)
  # The token slot commit + t must hold: NTP's choice from the logits at the slot before it.
  # Slot `commit` itself is always verified already (NTP's token, set when its block began),
  # so the choice from before the window is never needed.
  expected_BP = jnp.concatenate([draft_BP[:, :1], choice_BP[:, :-1]], axis=1)
  checked_BP = (
    (t_P < causal_B[:, None]) & (slot_BP >= st.verified_B[:, None]) & st.verify_B[:, None]
  )
  wrong_BP = checked_BP & (draft_BP != expected_BP)
  first_wrong_B = jnp.min(jnp.where(wrong_BP, t_P, p), axis=-1)
  rejected_B = first_wrong_B < causal_B
  accepted_B = jnp.minimum(first_wrong_B, causal_B)  # slots whose keys and values are kept
  commit_B = st.commit_B + accepted_B

  slot_R = jnp.arange(r_slots)
  # A rejection: NTP's token at the first wrong slot, masks after it, the block restarts there.
  corrected_B = jnp.take_along_axis(expected_BP, jnp.minimum(first_wrong_B, p - 1)[:, None], 1)
  corrected_B = corrected_B[:, 0]
  at_wrong_BR = rejected_B[:, None] & (slot_R == commit_B[:, None])
  after_wrong_BR = rejected_B[:, None] & (slot_R > commit_B[:, None])
  # All accepted: the block's first slot gets NTP's choice from the last causal logits, unless
  # the draft had ended (with an EOS, or at the limit), which ends the row.
  checked_all_B = (causal_B > 0) & ~rejected_B & ~st.done_B & st.verify_B
  last_B = jnp.take_along_axis(st.tokens_BR, jnp.maximum(st.index - 1, 0)[:, None], 1)[:, 0]
  draft_ended_B = (st.index >= st.limit_B) | ((st.index > 0) & (last_B == s.eos_id))
  finished_B = checked_all_B & draft_ended_B
  forced_B = checked_all_B & ~draft_ended_B
  next_token_B = jnp.take_along_axis(choice_BP, jnp.maximum(causal_B - 1, 0)[:, None], 1)[:, 0]
  at_index_BR = forced_B[:, None] & (slot_R == st.index[:, None])

  # Every token verification settles, slot commit + t (t >= 1: accepted, corrected or forced),
  # is NTP's choice from the logits at the slot before it: its log-probability is NTP's.
  t_P1 = t_P + 1
  settles_BP = ((t_P1 <= first_wrong_B[:, None]) & (t_P1 < causal_B[:, None])) | (
    forced_B[:, None] & (t_P1 == causal_B[:, None])
  )
  settles_BP &= st.verify_B[:, None]  # a plain row's were written at its reveals
  logprob_BR = st.logprob_BR
  if s.logprobs:
    logprob_BR = scatter_slots(
      logprob_BR, slot_BP + 1, chosen_logprob(logp_BPV, choice_BP), settles_BP
    )
  tokens_BR = jnp.where(after_wrong_BR, s.mask_id, st.tokens_BR)
  tokens_BR = jnp.where(at_wrong_BR, corrected_B[:, None], tokens_BR)
  tokens_BR = jnp.where(at_index_BR, next_token_B[:, None], tokens_BR)
  steps_BR = jnp.where(after_wrong_BR, 0, st.reveal_step_BR)
  steps_BR = jnp.where(at_wrong_BR | at_index_BR, st.nfe_B[:, None], steps_BR)

  # Verified tokens: through the corrected one, or through the forced one.
  index_B = jnp.where(rejected_B, commit_B + 1, st.index)
  verified_B = jnp.where(rejected_B, commit_B + 1, st.verified_B)
  verified_B = jnp.where(forced_B, st.index + 1, jnp.where(finished_B, st.index, verified_B))
  new_token_B = jnp.where(rejected_B, corrected_B, next_token_B)
  ends_with_eos_B = (rejected_B | forced_B) & (new_token_B == s.eos_id)
  done_now_B = finished_B | (
    (rejected_B | forced_B) & (ends_with_eos_B | (verified_B >= st.limit_B))
  )
  st = st.replace(
    tokens_BR=tokens_BR,
    logprob_BR=logprob_BR,
    reveal_step_BR=steps_BR,
    length_B=jnp.where(done_now_B, jnp.minimum(verified_B, st.limit_B), st.length_B),
    done_B=st.done_B | done_now_B,
    index=index_B,
    commit_B=commit_B,
    verified_B=verified_B,
    rollbacks_B=st.rollbacks_B + rejected_B.astype(jnp.int32),
    cache=st.cache.replace(end=st.cache.end + accepted_B),
  )
  return st, rejected_B


def first_token(st: DecodeState, logits_BV: jax.Array, active_B: jax.Array, s: SamplerSettings):
  """After the prefill: NTP's first token (from the prompt's last logits) set at slot 0 of the
  verified rows, where their block 0 starts."""
  token_B1, logp_B1V = pick_at(logits_BV[:, None], st, jnp.zeros((len(st.key_B), 1), jnp.int32), s)
  token_B, logprob_B = token_B1[:, 0], chosen_logprob(logp_B1V, token_B1)[:, 0]
  live_B = active_B & ~st.done_B & st.verify_B
  at_0_BR = live_B[:, None] & (jnp.arange(st.tokens_BR.shape[1]) == 0)
  done_now_B = live_B & ((token_B == s.eos_id) | (st.limit_B <= 1))
  logprob_BR = st.logprob_BR
  if s.logprobs:
    logprob_BR = jnp.where(at_0_BR, logprob_B[:, None], logprob_BR)
  return st.replace(
    tokens_BR=jnp.where(at_0_BR, token_B[:, None], st.tokens_BR),
    logprob_BR=logprob_BR,
    reveal_step_BR=jnp.where(at_0_BR, st.nfe_B[:, None], st.reveal_step_BR),
    verified_B=jnp.where(live_B, 1, st.verified_B),
    length_B=jnp.where(done_now_B, 1, st.length_B),
    done_B=st.done_B | done_now_B,
  )
