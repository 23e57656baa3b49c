"""Verified SBD: every drafted token checked against NTP's own choice, so the text is NTP's.

A row's newest verified token sits at slot `commit`, not yet in the KV cache; after it come
the drafts revealed since (the run up to `index`), then its block. A wide forward sends
[slots commit .. index, causal ; the block] (`loop`). Its causal half computes what NTP would:
the logits at slot t give NTP's token for slot t + 1. Those check the run, as speculative
decoding checks a drafter's tokens, with the model as its own drafter and no extra forward
(`check_drafts`):

- Every draft equals NTP's choice: the run is committed to the cache, and the first masked
  slot (`index`, the block's first) gets NTP's token at once: a block's first token is never a
  guess.
- At the first disagreement, slot r: slots before r are kept, and NTP's token is set at r. The
  cache keeps the keys and values of the slots before r only (those of r and after came from
  rejected tokens), the drafts after r and this forward's block are discarded, and the next
  block starts at r + 1.

Either way a forward settles at least one token of NTP's, so a verified answer never costs
more forwards than NTP's. When every forward checks (`SamplerSettings.check_every_forward`,
the default) the run is whatever the previous forwards revealed after the verified token, and
the block slides to start after it: a wrong draft costs one forward's block. Checked per block,
the run is the previous block once it is complete, and a wrong token revealed in the first of
l forwards of a block wastes all l. NTP's one-token forward ([the verified token], `loop`)
checks a run of one: it settles slot commit + 1, a draft kept or corrected, or a mask given
NTP's token.

So the cache only ever holds a causal forward's keys and values of NTP's text, and a row ends
when its verified tokens end with an EOS or reach its limit.

Which forward runs next (NTP's one-token forward, or a wide forward of which width) is the
policy's choice (`policy`), fed by each check's drafted and accepted tokens (`Check`); the
check itself never depends on it.

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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sbd_jax.decode import constrained
from sbd_jax.decode.sampling import chosen_logprob, pick_at
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState, scatter_slots


class Check(NamedTuple):
  """What one check found, per row ([B, T]: the T checked slots)."""

  rejected_B: jax.Array  # a draft was wrong: the row rolled back (its block logits are stale)
  drafted_BT: jax.Array  # slots that held a draft
  accepted_BT: jax.Array  # of them, accepted (a prefix)


def check_drafts(
  st: DecodeState, causal_logits_BPV: jax.Array, causal_B: jax.Array, s: SamplerSettings
) -> tuple[DecodeState, Check]:
  """Check each row's `causal_B` tokens from slot `commit` with NTP's choices from
  `causal_logits_BPV` (the logits at those slots; `causal_B` = 0: nothing to check), and commit
  or roll back (module docstring). The choice from the logits at slot t settles slot t + 1: a
  draft there is kept where it equals NTP's and corrected at the first that does not (the
  slots after it are discarded); the first masked slot (`index`) gets NTP's token. `st.cache`
  holds this forward's writes from its end, which moves past the slots whose tokens are kept;
  `st.nfe_B` already counts this forward. Returns the state and what the check found."""
  b, p = causal_logits_BPV.shape[:2]
  r_slots = st.tokens_BR.shape[1]
  t_P = jnp.arange(p)
  slot_BP = st.commit_B[:, None] + t_P + 1  # the slot each causal position's logits settle
  token_BP = jnp.take_along_axis(st.tokens_BR, jnp.minimum(slot_BP, r_slots - 1), axis=1)
  if s.constrained:  # NTP's constrained choice, at the state the run's tokens lead to
    causal_logits_BPV, state_BP = constrained.checked(st, causal_logits_BPV, token_BP)
  choice_BP, logp_BPV = pick_at(causal_logits_BPV, st, slot_BP, s)
  before_BP = jnp.take_along_axis(st.tokens_BR, jnp.minimum(slot_BP - 1, r_slots - 1), axis=1)
  # A verified row's tokens end at an EOS or at its limit: no slot past them is settled.
  past_end_BP = (slot_BP >= st.limit_B[:, None]) | (before_BP == st.eos_id)
  live_B = st.verify_B & ~st.done_B
  settles_BP = (t_P < causal_B[:, None]) & live_B[:, None] & ~past_end_BP
  drafted_BP = settles_BP & (slot_BP < st.index[:, None])  # a draft there; else a mask
  wrong_BP = drafted_BP & ((token_BP != choice_BP) | st.tuning.reject)  # reject: `costs`
  first_wrong_B = jnp.min(jnp.where(wrong_BP, t_P, p), axis=-1)
  settles_BP &= t_P <= first_wrong_B[:, None]  # the first wrong draft is corrected, no later
  rejected_B = first_wrong_B < p
  accepted_BP = drafted_BP & (t_P < first_wrong_B[:, None])
  settled_B = jnp.sum(settles_BP, axis=-1)

  # The causal slots whose keys and values stay: those before the first wrong draft.
  kept_B = jnp.where(live_B, jnp.minimum(first_wrong_B + 1, causal_B), causal_B)
  commit_B = st.commit_B + kept_B
  verified_B = jnp.where(live_B, st.commit_B + 1 + settled_B, st.verified_B)
  slot_R = jnp.arange(r_slots)
  write_BP = settles_BP & ~accepted_BP  # corrected and forced slots take NTP's choice
  tokens_BR = scatter_slots(st.tokens_BR, slot_BP, choice_BP, write_BP)
  after_wrong_BR = rejected_B[:, None] & (slot_R >= verified_B[:, None])
  tokens_BR = jnp.where(after_wrong_BR, s.mask_id, tokens_BR)
  step_BP = jnp.broadcast_to(st.nfe_B[:, None], (b, p))
  steps_BR = scatter_slots(st.reveal_step_BR, slot_BP, step_BP, write_BP)
  steps_BR = jnp.where(after_wrong_BR, 0, steps_BR)
  logprob_BR = st.logprob_BR
  if s.logprobs:  # every settled token is NTP's choice: its log-probability is NTP's
    logprob_BP = chosen_logprob(logp_BPV, choice_BP)
    logprob_BR = scatter_slots(logprob_BR, slot_BP, logprob_BP, settles_BP)

  if s.constrained:
    st = constrained.settle(st, state_BP, choice_BP, settles_BP)
  last_B = jnp.take_along_axis(tokens_BR, jnp.maximum(verified_B - 1, 0)[:, None], 1)[:, 0]
  done_now_B = live_B & (settled_B > 0) & ((verified_B >= st.limit_B) | (last_B == st.eos_id))
  st = st.replace(
    tokens_BR=tokens_BR,
    logprob_BR=logprob_BR,
    reveal_step_BR=steps_BR,
    length_B=jnp.where(done_now_B, jnp.minimum(verified_B, st.limit_B), st.length_B),
    done_B=st.done_B | done_now_B,
    index=jnp.where(rejected_B, verified_B, st.index),
    commit_B=commit_B,
    verified_B=verified_B,
    rollbacks_B=st.rollbacks_B + rejected_B.astype(jnp.int32),
    acceptance=st.acceptance.add(drafted_BP, accepted_BP, st.estimates.next_at_B),
    cache=st.cache.replace(end=st.cache.end + kept_B),
  )
  return st, Check(rejected_B, drafted_BP, accepted_BP)


def first_token(st: DecodeState, logits_BV: jax.Array, active_B: jax.Array, s: SamplerSettings):
  """After the prefill: NTP's first token (from the prompt's last logits) set at slot 0 of the
  verified rows, where their block 0 starts."""
  logits_B1V = logits_BV[:, None]
  if s.constrained:
    logits_B1V = constrained.masked_now(st, logits_B1V)
  token_B1, logp_B1V = pick_at(logits_B1V, st, jnp.zeros((len(st.key_B), 1), jnp.int32), s)
  token_B, logprob_B = token_B1[:, 0], chosen_logprob(logp_B1V, token_B1)[:, 0]
  live_B = active_B & ~st.done_B & st.verify_B
  if s.constrained:
    st = constrained.settle(st, st.cstate_B[:, None], token_B1, live_B[:, None])
  at_0_BR = live_B[:, None] & (jnp.arange(st.tokens_BR.shape[1]) == 0)
  done_now_B = live_B & ((token_B == st.eos_id) | (st.limit_B <= 1))
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


def settle_next(st: DecodeState, logits_B1V: jax.Array, live_B: jax.Array, s: SamplerSettings):
  """NTP's forward where no row in `live_B` has a draft to check: each such row's next slot,
  commit + 1, gets NTP's choice from `logits_B1V` (its verified token's logits). What
  `check_drafts` does over one causal token when the slot holds no draft, with none of its
  draft bookkeeping (`loop`: a stretch of such forwards costs what NTP's decode does)."""
  slot_B = st.commit_B + 1
  slot_B1 = slot_B[:, None]
  if s.constrained:
    logits_B1V = constrained.masked_now(st, logits_B1V)
  choice_B1, logp_B1V = pick_at(logits_B1V, st, slot_B1, s)
  write_BR = live_B[:, None] & (jnp.arange(st.tokens_BR.shape[1]) == slot_B1)
  logprob_BR = st.logprob_BR
  if s.logprobs:
    logprob_BR = jnp.where(write_BR, chosen_logprob(logp_B1V, choice_B1), logprob_BR)
  if s.constrained:
    st = constrained.settle(st, st.cstate_B[:, None], choice_B1, live_B[:, None])
  verified_B = jnp.where(live_B, slot_B + 1, st.verified_B)
  done_now_B = live_B & ((verified_B >= st.limit_B) | (choice_B1[:, 0] == st.eos_id))
  kept_B = live_B.astype(jnp.int32)
  return st.replace(
    tokens_BR=jnp.where(write_BR, choice_B1, st.tokens_BR),
    logprob_BR=logprob_BR,
    reveal_step_BR=jnp.where(write_BR, st.nfe_B[:, None], st.reveal_step_BR),
    length_B=jnp.where(done_now_B, jnp.minimum(verified_B, st.limit_B), st.length_B),
    done_B=st.done_B | done_now_B,
    index=jnp.maximum(st.index, verified_B),
    commit_B=st.commit_B + kept_B,
    verified_B=verified_B,
    cache=st.cache.replace(end=st.cache.end + kept_B),
  )
