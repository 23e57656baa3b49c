"""Each row's first forward over an empty cache (`loop`, `queue`, the server's `slots`): NTP's
prefill, the prompt alone, whose last logits give the first token; SBD's fused prefill,
[prompt (causal) ; P masks], which is also the first pass of block 0 (paper Algorithm 3).

Dimension letters (docs/dimensions.md): B batch, Q prompt slots, P block positions, V
vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import policy, verify
from sbd_jax.decode.reveal import ntp_record, sbd_reveal
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState, RowLayout, prompt_meta, row_slices
from sbd_jax.sbd.masks import decode_meta


def count_forward(st: DecodeState, active_B: jax.Array, s: SamplerSettings, alone: bool):
  """Every row still decoding counts the forward about to run in its NFE; in lockstep, a row
  whose block is complete waits for the others without counting."""
  counted_B = active_B & ~st.done_B
  if not alone:
    block_BP = row_slices(st.tokens_BR, st.index, s.block_size, alone)
    in_range_BP = st.index[:, None] + jnp.arange(s.block_size) < st.limit_B[:, None]
    counted_B &= jnp.any((block_BP == s.mask_id) & in_range_BP, axis=-1)
  return st.replace(nfe_B=st.nfe_B + counted_B.astype(jnp.int32))


def prefill(st, prompt_BQ, rows: RowLayout, forward, s, gamma, active_B, alone) -> DecodeState:
  """Each row's first forward over an empty cache. NTP: the prompt, which yields the first
  token. SBD (fused): [prompt (causal) ; P masks], which prefills the cache and is the first
  pass of block 0. A verified decode that chooses its forwards fuses the block only where its
  policy drafts (`policy.prefill_drafts`: from the prior and the costs); else its prefill is
  NTP's, the prompt alone, whose logits give NTP's first token (`verify`), and the row's first
  drafts wait for the policy (a wide forward, or a probe). On a compute-bound device P masks
  after a short prompt cost a good part of the prefill again."""
  b, l = prompt_BQ.shape
  seg_BQ, pos_BQ = prompt_meta(rows.prompt_len_B, l)
  if s.mode == "ntp":
    logits_B1V, cache = forward(prompt_BQ, TokenMeta.causal(seg_BQ, pos_BQ), st.cache, last=1)
    end = jnp.full(jnp.shape(st.index), l, jnp.int32)
    return ntp_record(st.replace(cache=cache.replace(end=end)), logits_B1V[:, 0], s)
  fuse = functools.partial(
    _fused_prefill, prompt_BQ=prompt_BQ, rows=rows, forward=forward, s=s, gamma=gamma,
    active_B=active_B, alone=alone,
  )  # fmt: skip
  if not (s.chooses_forwards and st.tokens_BR.shape[1] > s.block_size):
    return fuse(st)  # plain SBD, or a single block (the prefill is its first pass)
  first_token = functools.partial(
    _first_token_prefill, prompt_BQ=prompt_BQ, rows=rows, forward=forward, s=s, active_B=active_B
  )
  drafts = policy.prefill_drafts(st, active_B, s)
  st = st.replace(cache=st.cache.replace(end=jnp.zeros((b,), jnp.int32)))  # one offset a row
  return _run_if(~drafts, first_token, _run_if(drafts, fuse, st))


def _run_if(pred: jax.Array, fn, st: DecodeState) -> DecodeState:
  """`fn(st)` where `pred` (a traced bool), else `st`: a while loop that runs at most once. Not
  `lax.cond`, whose branches get copies of the KV cache (`decode_while`)."""
  body = lambda carry: (fn(carry[0]), jnp.zeros((), bool))  # noqa: E731
  return jax.lax.while_loop(lambda carry: carry[1], body, (st, pred))[0]


def _first_token_prefill(st, prompt_BQ, rows: RowLayout, forward, s, active_B) -> DecodeState:
  """A verified row's prefill in NTP's shape: the prompt alone; its last logits settle slot 0
  (`verify.first_token`), and the row's block starts after it, nothing drafted."""
  b, l = prompt_BQ.shape
  seg_BQ, pos_BQ = prompt_meta(rows.prompt_len_B, l)
  st = count_forward(st, active_B, s, alone=True)
  logits_B1V, cache = forward(prompt_BQ, TokenMeta.causal(seg_BQ, pos_BQ), st.cache, last=1)
  st = st.replace(cache=cache.replace(end=jnp.full((b,), l, jnp.int32)))
  st = verify.first_token(st, logits_B1V[:, 0], active_B, s)
  return st.replace(index=jnp.maximum(st.index, st.verified_B))


def _fused_prefill(st, prompt_BQ, rows: RowLayout, forward, s, gamma, active_B, alone):
  """[prompt (causal) ; P masks]: the prompt's cache and block 0's first pass."""
  b, l = prompt_BQ.shape
  seg_BQ, pos_BQ = prompt_meta(rows.prompt_len_B, l)
  p = s.block_size
  meta = decode_meta(
    jnp.concatenate([pos_BQ, rows.gen_pos_BR[:, :p]], axis=1),
    jnp.concatenate([seg_BQ, jnp.ones((b, p), jnp.int32)], axis=1),
    rows.prompt_len_B,
    num_clean=l,
  )
  masks_BP = jnp.full((b, p), s.mask_id, jnp.int32)
  tokens_BT = jnp.concatenate([prompt_BQ, masks_BP], axis=1)
  st = count_forward(st, active_B, s, alone)
  end = jnp.full((b,) if alone else (), l, jnp.int32)  # per-row cache offsets when rows move alone
  if s.verified:  # and the prompt's last logits: NTP's first token, block 0's first
    logits_BXV, cache = forward(tokens_BT, meta, st.cache, last=p + 1)
    st = verify.first_token(st.replace(cache=cache.replace(end=end)), logits_BXV[:, 0], active_B, s)
    return sbd_reveal(st, logits_BXV[:, 1:], active_B, s, gamma, alone)
  logits_BPV, cache = forward(tokens_BT, meta, st.cache, last=p)
  st = st.replace(cache=cache.replace(end=end))
  return sbd_reveal(st, logits_BPV, active_B, s, gamma, alone)
