"""Verified SBD's NTP forward: [each row's newest verified token], one token a row, causal
(`loop`, where the policy chooses it). `checked` checks a draft at the next slot or settles
NTP's token there (`verify.check_drafts`); `settled`, where no row has a draft left and nothing
could change the choice (`policy.unchanged_for`), only settles NTP's token
(`verify.settle_next`), with the work of NTP's own decode.

Dimension letters (docs/dimensions.md): B batch, V vocabulary.
"""

from __future__ import annotations

import jax.numpy as jnp

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import policy, verify
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState, RowLayout, row_slices


def checked(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings) -> DecodeState:
  """NTP's forward for verified rows: [the newest verified token] per row, causal. Its logits
  settle the next slot: a draft there kept or corrected, or a mask given NTP's token
  (`verify.check_drafts` over one causal token); nothing is drafted. Rows that are done send a
  placeholder (segment 0) that their cache's end does not pass."""
  live_B = st.verify_B & ~st.done_B
  logits_B1V, st = _forward(st, rows, forward, s, live_B)
  st, check = verify.check_drafts(st, logits_B1V, live_B.astype(jnp.int32), s)
  st = st.replace(estimates=policy.observe(st, check.drafted_BT, check.accepted_BT))
  # The block starts at the first slot NTP has not settled, or after the drafts still waiting.
  return _counted(st.replace(index=jnp.maximum(st.index, st.verified_B)))


def settled(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings, live_B) -> DecodeState:
  """`checked` where no row has a draft left to check and the choice stays NTP's
  (`policy.unchanged_for`): the forward, NTP's token at each live row's next slot
  (`verify.settle_next`), and the counts, without the checks' and the policy's bookkeeping.
  The forward counts in the NFE of the rows in `live_B` (`checked`'s caller counts its own)."""
  st = st.replace(nfe_B=st.nfe_B + live_B.astype(jnp.int32))
  logits_B1V, st = _forward(st, rows, forward, s, live_B)
  return _counted(verify.settle_next(st, logits_B1V, live_B, s))


def _forward(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings, live_B):
  """(the logits [B, 1, V] of each row's newest verified token, the state with the cache
  written); rows outside `live_B` send a placeholder."""
  token_B1 = jnp.take_along_axis(st.tokens_BR, st.commit_B[:, None], axis=1)
  meta = TokenMeta.causal(
    live_B[:, None].astype(jnp.int32), row_slices(rows.gen_pos_BR, st.commit_B, 1, alone=True)
  )
  logits_B1V, cache = forward(jnp.where(live_B[:, None], token_B1, s.pad_id), meta, st.cache)
  return logits_B1V, st.replace(cache=cache)


def _counted(st: DecodeState) -> DecodeState:
  """`st` with one more NTP forward counted."""
  return st.replace(
    forwards=st.forwards + 1,
    ntp_forwards=st.ntp_forwards + 1,
    kind_forwards_K=st.kind_forwards_K.at[policy.NTP].add(1),
  )
