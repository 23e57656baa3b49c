"""The on-device decode: KV-cached Set Block Decoding (paper Algorithm 3) and next-token
decoding of a whole batch in one `lax.while_loop`. Compiled by `compiled.decode_batch`; a queue
of prompts through one set of rows, finished rows refilled, is `queue.decode_queue`, which
reuses the pieces here (`prefill`, from `decode.prefill`, and `decode_while`).

Forwards (SBD, paper Algorithms 2-3). The first forward is fused: [prompt (causal) ; P masks]
prefills the cache and is the first pass of block 0 (`prefill`, where a verified decode's
policy drafts then). The first pass of block j >= 1 is [block j-1 (causal, committed to the
cache) ; block j] (2P tokens, a "wide" forward); later
passes are the P block tokens alone. After each forward a reveal rule (`reveal.sbd_reveal`)
fills some masked positions. NTP uses the same cache code: the prefill forward yields the first
token, then one token per forward. Verified SBD (`verify`) sends as causal tokens the tokens
decided since the cache's end (the run of drafts after its newest verified token) and checks
them with that forward's causal logits: at every forward (`check_every_forward`; its block
then slides to start after the run, so every verified row's forward is wide), or in a block's
first pass only. Its blocks start wherever a check ends. Checked at every forward and
`adaptive`, the decode chooses each forward (`policy`): NTP's forward, [the newest verified
token] per row, whose logits settle the next slot (`one_token.checked`), or a wide forward
drafting a block of one of `draft_widths` (2D tokens a row, the run cut to its first D
tokens). NTP's forwards that nothing could choose otherwise (no draft left to check, no row
ending, no probe falling due: `policy.unchanged_for`) run without the checks' and the policy's
bookkeeping (`one_token.settled`), as NTP's own decode runs them.

Rows of a batch move through their blocks alone: a row whose block is complete starts its next
block in the next forward, whatever the other rows do. A forward is wide when some row starts a
block; the other rows send their block followed by P placeholder tokens (segment 0: they see and
are seen by nothing), and each row writes at its own cache offset (a scatter). In lockstep
(`lockstep=True`) the batch instead waits at every block for its slowest row: one cache offset for
the batch (a dynamic-update-slice), a wide forward only when all rows start a block together. A
single row is the same either way, and so are every row's tokens, reveal steps and NFE. (A
verified row's forwards are its batch's choice when the decode chooses them: they depend on its
neighbours; its text, NTP's, does not.) On TPU the cache is stored heads-first
(`KVCache.heads_first`), the layout in which the per-row write needs no copy of the cache
(`sbd_jax.model.kv_cache`).

Dimension letters (docs/dimensions.md): B batch, Q prompt slots, T new tokens of one forward,
S cache slots, V vocabulary, P block positions (the SBD block size k), R response slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from sbd_jax import sharding
from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import one_token, policy, verify
from sbd_jax.decode.prefill import count_forward, prefill
from sbd_jax.decode.reveal import ntp_record, sbd_reveal
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import (
  DecodeState,
  RowLayout,
  initial_state,
  row_slices,
)
from sbd_jax.model.kv_cache import KVCache
from sbd_jax.sbd.masks import decode_meta


def model_forward(
  graphdef, state, tokens_BT, meta: TokenMeta, cache: KVCache, mesh, last: int = 0, keep_BT=None
):
  """Logits of the last `last` positions (0 = all), or with `keep_BT` [B, T'] of those
  positions of each row, and the updated cache. The prefill needs only the prompt's last
  position (NTP) or the block (SBD): at a 128k vocabulary the logits of every prompt position
  would be gigabytes."""
  model = nnx.merge(graphdef, state)
  x_BTD, cache = model.features(tokens_BT, meta, cache)
  if keep_BT is not None:
    x_BTD = jnp.take_along_axis(x_BTD, keep_BT[:, :, None], axis=1)
  elif last:
    x_BTD = x_BTD[:, -last:]
  logits_BTV = model.logits(x_BTD)
  if mesh is not None:
    spec = cache.logical_axes
    cache = cache.replace(
      k=tuple(sharding.constrain(k, spec) for k in cache.k),
      v=tuple(sharding.constrain(v, spec) for v in cache.v),
    )
  return logits_BTV, cache


def platform(mesh) -> str:
  """The platform the decode is compiled for: the mesh's (an AOT mesh may be a TPU slice
  described on a CPU host), else the default backend's."""
  return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def _wide_pass(
  st: DecodeState, rows: RowLayout, forward, s: SamplerSettings, alone: bool, width: int = 0
):
  """2D tokens per row (D = `width`, by default the block size P), the first pass of a block for
  the rows that start one: [the c tokens decided since the cache's end (causal) ; the block of
  D ; D - c placeholders]. A row already in its block sends c = 0. In plain SBD c is the previous
  block's P; verified, the run of drafts to check (`verify`), cut to its first D tokens, or after
  a rollback the one corrected token. Either way the block lands at the slots after the causal
  ones, as in a later pass; placeholders (segment 0) see and are seen by nothing, and no stale
  copy of a block is left where the block's queries would see it. Returns (the block's logits
  [B, D, V], the state with the causal tokens committed or, verified, checked, and which rows'
  block logits are stale: a rolled-back draft's)."""
  b, p = st.tokens_BR.shape[0], s.block_size
  if not alone:  # lockstep: every row starts its block
    start_B = st.index
    meta = decode_meta(
      row_slices(rows.gen_pos_BR, start_B - p, 2 * p, alone),
      jnp.ones((b, 2 * p), jnp.int32),
      rows.prompt_len_B + start_B,
      num_clean=p,
    )
    tokens_BT = row_slices(st.tokens_BR, start_B - p, 2 * p, alone)
    logits_BPV, cache = forward(tokens_BT, meta, st.cache, last=p)
    st = _counted_wide(st, s, p)
    st = st.replace(cache=cache.replace(end=cache.end + p), commit_B=st.index)
    return logits_BPV, st, jnp.zeros((b,), bool)
  d = width or p
  if d < p:
    st = _cut_runs(st, d, s.mask_id)
  starts_B = (st.commit_B < st.index) & ~st.done_B
  causal_B = jnp.where(starts_B, st.index - st.commit_B, 0)
  t_T = jnp.arange(2 * d)
  slot_BT = (st.index - causal_B)[:, None] + t_T
  causal_BT = t_T < causal_B[:, None]
  block_BT = ~causal_BT & (t_T < causal_B[:, None] + d)
  real_BT = causal_BT | block_BT
  r = st.tokens_BR.shape[1]
  tokens_BT = jnp.take_along_axis(st.tokens_BR, jnp.clip(slot_BT, 0, r - 1), axis=1)
  meta = TokenMeta(
    segment_ids=real_BT.astype(jnp.int32),
    positions=jnp.where(real_BT, rows.prompt_len_B[:, None] + slot_BT, 0),
    is_block=block_BT,
    block_start=jnp.broadcast_to((rows.prompt_len_B + st.index)[:, None], (b, 2 * d)),
  )
  keep_BD = causal_B[:, None] + jnp.arange(d)  # the block
  if s.verified:  # and the causal tokens' logits, NTP's: they check the draft
    keep_BD = jnp.concatenate([jnp.broadcast_to(jnp.arange(d), (b, d)), keep_BD], axis=1)
  tokens_BT = jnp.where(real_BT, tokens_BT, s.pad_id)
  logits_BXV, cache = forward(tokens_BT, meta, st.cache, keep_BT=keep_BD)
  st = _counted_wide(st.replace(cache=cache), s, d)
  if s.verified:
    st, check = verify.check_drafts(st, logits_BXV[:, :d], causal_B, s)
    st = st.replace(estimates=policy.observe(st, check.drafted_BT, check.accepted_BT))
    return logits_BXV[:, d:], st, check.rejected_B
  st = st.replace(
    cache=cache.replace(end=cache.end + causal_B),
    commit_B=jnp.where(starts_B, st.index, st.commit_B),
  )
  return logits_BXV, st, jnp.zeros((b,), bool)


def _counted_wide(st: DecodeState, s: SamplerSettings, width: int) -> DecodeState:
  """`st` with one more wide forward counted, of width `width`."""
  kind = 1 + s.draft_widths.index(width)
  return st.replace(
    wide_forwards=st.wide_forwards + 1, kind_forwards_K=st.kind_forwards_K.at[kind].add(1)
  )


def _cut_runs(st: DecodeState, d: int, mask_id: int) -> DecodeState:
  """Verified rows whose run of drafts is longer than a forward of width D checks: the drafts
  after its first D tokens are dropped (masked again), and the block starts after them. Drafts
  are never text: dropping them only loses what they might have saved."""
  r = st.tokens_BR.shape[1]
  over_B = st.verify_B & ~st.done_B & (st.index - st.commit_B > d)
  cut_B = st.commit_B + d
  slot_R = jnp.arange(r)
  drop_BR = over_B[:, None] & (slot_R >= cut_B[:, None]) & (slot_R < st.index[:, None])
  return st.replace(
    tokens_BR=jnp.where(drop_BR, mask_id, st.tokens_BR),
    reveal_step_BR=jnp.where(drop_BR, 0, st.reveal_step_BR),
    index=jnp.where(over_B, cut_B, st.index),
  )


def _later_pass(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings, alone: bool):
  """[current block]: P tokens over the cache."""
  p = s.block_size
  start_B = st.index
  tokens_BP = row_slices(st.tokens_BR, start_B, p, alone)
  pos_BP = row_slices(rows.gen_pos_BR, start_B, p, alone)
  meta = decode_meta(pos_BP, jnp.ones_like(tokens_BP), rows.prompt_len_B + start_B, num_clean=0)
  logits_BPV, cache = forward(tokens_BP, meta, st.cache)
  return logits_BPV, st.replace(cache=cache), jnp.zeros((tokens_BP.shape[0],), bool)


def _ntp_step(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings) -> DecodeState:
  """One NTP forward: the last sampled token of every row, then the next one sampled."""
  g = st.index
  if jnp.ndim(g) == 0:  # one token slot for the batch
    token_B1 = jax.lax.dynamic_slice_in_dim(st.tokens_BR, g - 1, 1, axis=1)
    pos_B1 = jax.lax.dynamic_slice_in_dim(rows.gen_pos_BR, g - 1, 1, axis=1)
    committed = 1
  else:  # a slot per row: finished rows stay where they are
    token_B1 = row_slices(st.tokens_BR, g - 1, 1, alone=True)
    pos_B1 = row_slices(rows.gen_pos_BR, g - 1, 1, alone=True)
    committed = (~st.done_B).astype(jnp.int32)
  meta = TokenMeta.causal(jnp.ones_like(pos_B1), pos_B1)
  logits_B1V, cache = forward(token_B1, meta, st.cache)
  st = st.replace(cache=cache.replace(end=cache.end + committed))
  return ntp_record(st, logits_B1V[:, 0], s)


def decode_while(st, rows: RowLayout, forward, s, gamma, active_B, alone, go) -> DecodeState:
  """The forwards after the prefill, each followed by its reveal, while `go(st)`."""
  if s.mode == "ntp":
    return jax.lax.while_loop(go, lambda st: _ntp_step(st, rows, forward, s), st)

  def choose(st: DecodeState) -> DecodeState:
    """The next forward's kind (`policy.choose`), where the decode chooses its forwards."""
    if not s.chooses_forwards:
      return st
    return st.replace(kind=policy.choose(st, active_B, s))

  def step(pass_fn):
    def body(st: DecodeState) -> DecodeState:
      st = count_forward(st, active_B, s, alone)
      logits_BPV, st, stale_B = pass_fn(st, rows, forward, s, alone)
      return choose(sbd_reveal(st, logits_BPV, active_B & ~stale_B, s, gamma, alone))

    return body

  def some_row_starts(st: DecodeState) -> jax.Array:
    return jnp.any((st.commit_B < st.index) & ~st.done_B)

  if st.tokens_BR.shape[1] == s.block_size:  # a single block: the prefill was its first pass
    return jax.lax.while_loop(go, step(_later_pass), st)

  def wide_step(width: int):
    def wide(st, rows, forward, s, alone):
      if s.chooses_forwards:  # every row drafts: the rows' probes are served
        st = st.replace(estimates=policy.drafting(st, active_B, s))
      return _wide_pass(st, rows, forward, s, alone, width)

    return step(wide)

  def ntp_step(st: DecodeState) -> DecodeState:
    st = one_token.checked(count_forward(st, active_B, s, alone), rows, forward, s)
    return choose(st)

  # One forward per step: NTP's (kind 0), or wide forwards of the chosen width while some row
  # starts a block, and later passes while none does (plain rows only). One inner loop per kind
  # rather than `lax.cond`: a conditional whose branches update the KV cache in place gets copies
  # of the whole cache on this path (into the branch and out of it, every forward); a while loop
  # updates its carry in place.
  widths = s.draft_widths
  full = len(widths)  # the kind of the block's own width, where nothing is chosen

  def stretch(st: DecodeState) -> DecodeState:
    """NTP's forwards that cannot change the choice (`policy.unchanged_for`), run as NTP's own
    decode runs them: the policy's and the checks' work per forward would cost a small model
    about as much as its forward. It ends early where a row ends; then the policy chooses."""
    done_B = st.done_B

    def more(carry):
      st, left = carry
      return (left > 0) & jnp.all(st.done_B == done_B) & go(st)

    def settle(carry):
      st, left = carry
      return one_token.settled(st, rows, forward, s, active_B & ~st.done_B), left - 1

    st, _ = jax.lax.while_loop(more, settle, (st, policy.unchanged_for(st, active_B, s)))
    return choose(st)

  def blocks(st: DecodeState) -> DecodeState:
    for kind, width in enumerate(widths, start=1):
      chosen = lambda st, kind=kind: (st.kind == kind) & some_row_starts(st) & go(st)  # noqa: E731
      st = jax.lax.while_loop(chosen, wide_step(width), st)
    later = lambda st: ~some_row_starts(st) & go(st)  # noqa: E731
    st = jax.lax.while_loop(later, step(_later_pass), st)
    if not s.chooses_forwards:
      return st
    st = stretch(st)

    def checking(st: DecodeState) -> jax.Array:  # NTP's forwards that check or may change
      return (st.kind == policy.NTP) & go(st) & (policy.unchanged_for(st, active_B, s) == 0)

    return jax.lax.while_loop(checking, ntp_step, st)

  st = choose(st) if s.chooses_forwards else st.replace(kind=jnp.int32(full))
  return jax.lax.while_loop(go, blocks, st)


def _running(st: DecodeState) -> jax.Array:
  return ~jnp.all(st.done_B)


def decode_rows(
  graphdef,
  state,
  prompt_BQ,
  prompt_len_B,
  active_B,
  key_B,
  gamma,
  *,
  settings,
  model_cfg,
  cache_length,
  mesh,
  temperature=0.0,
  tuning=None,
  limit=None,
  ctables=None,
  cstate=0,
):
  """Decode a whole batch on device (paper Algorithm 3): the prefill, then forwards and
  reveals until every row is done. Returns the final `DecodeState`. `temperature`: the rows'
  (`state.initial_state`), read when `settings` sample; `tuning`: how a verified decode
  chooses its forwards (`policy.Tuning`); `limit`: tokens each row may generate, at most
  `settings.max_new_tokens` (traced; default that); `ctables`, `cstate`: a constrained decode's
  automaton tables and the rows' initial states (`decode.constrained`)."""
  s = settings
  b, l = prompt_BQ.shape
  alone = s.rows_move_alone(b)
  if cache_length < s.cache_slots(l, b):
    raise ValueError(f"cache_length {cache_length} < the {s.cache_slots(l, b)} slots needed")
  # Heads-first on TPU (the layout attention reads there: see sbd_jax.model).
  cache = KVCache.empty(model_cfg, b, cache_length, heads_first=platform(mesh) == "tpu")
  st = initial_state(
    s, cache, key_B, ~active_B, row_index=s.mode == "sbd", temperature=temperature, tuning=tuning,
    ctables=ctables, cstate=cstate,
  )  # fmt: skip
  if limit is not None:
    st = st.replace(limit_B=jnp.minimum(st.limit_B, jnp.asarray(limit, jnp.int32)))
  rows = RowLayout.of(prompt_len_B, s.response_slots)
  forward = functools.partial(model_forward, graphdef, state, mesh=mesh)
  st = prefill(st, prompt_BQ, rows, forward, s, gamma, active_B, alone)
  return decode_while(st, rows, forward, s, gamma, active_B, alone, _running)
