"""The on-device decode: KV-cached Set Block Decoding (paper Algorithm 3) and next-token
decoding of a whole batch in one `lax.while_loop`. Compiled by `compiled.decode_batch`; a queue
of prompts through one set of rows, finished rows refilled, is `queue.decode_queue`, which
reuses the pieces here (`prefill`, `decode_while`).

Forwards (SBD, paper Algorithms 2-3). The first forward is fused: [prompt (causal) ; P masks]
prefills the cache and is the first pass of block 0. The first pass of block j >= 1 is
[block j-1 (causal, committed to the cache) ; block j] (2P tokens, a "wide" forward); later
passes are the P block tokens alone. After each forward a reveal rule (`reveal.sbd_reveal`)
fills some masked positions. NTP uses the same cache code: the prefill forward yields the first
token, then one token per forward.

Rows of a batch move through their blocks alone: a row whose block is complete starts its next
block in the next forward, whatever the other rows do. A forward is wide when some row starts a
block; the other rows send their block followed by P placeholder tokens (segment 0: they see
and are seen by nothing), and each row writes at its own cache offset (a scatter). In
lockstep (`lockstep=True`) the batch instead waits at every block for its slowest row: one
cache offset for the batch (a dynamic-update-slice), a wide forward only when all rows start a
block together. A single row is the same either way, and so are every row's tokens, reveal
steps and NFE. On TPU the cache is stored heads-first (`KVCache.heads_first`), the layout in
which the per-row write needs no copy of the cache (`sbd_jax.model.kv_cache`).

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
from sbd_jax.decode.reveal import ntp_record, sbd_reveal
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import (
  DecodeState,
  RowLayout,
  initial_state,
  prompt_meta,
  row_slices,
)
from sbd_jax.model.kv_cache import KVCache
from sbd_jax.sbd.masks import decode_meta


def model_forward(
  graphdef, state, tokens_BT, meta: TokenMeta, cache: KVCache, mesh, last: int = 0, first_B=None
):
  """Logits of the last `last` positions (0 = all) and the updated cache; with `first_B` [B],
  of the first `last` positions instead in the rows where it is True. The prefill needs only
  the prompt's last position (NTP) or the block (SBD): at a 128k vocabulary the logits of every
  prompt position would be gigabytes."""
  model = nnx.merge(graphdef, state)
  x_BTD, cache = model.features(tokens_BT, meta, cache)
  if last:
    x_tail = x_BTD[:, -last:]
    x_BTD = (
      x_tail if first_B is None else jnp.where(first_B[:, None, None], x_BTD[:, :last], x_tail)
    )
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


def _wide_pass(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings, alone: bool):
  """2P tokens per row: [block j-1, causal, committed ; block j] for a row starting block j,
  [block j ; P placeholders] for a row already in it. Either way the block lands at the slots
  after the committed ones, as in a later pass; placeholders (segment 0) see and are seen by
  nothing, and no stale copy of a block is left where the block's queries would see it.
  Returns (logits [B, P, V], cache, wide forwards)."""
  b, p = st.tokens_BR.shape[0], s.block_size
  ones_BP = jnp.ones((b, p), jnp.int32)
  start_B = st.index * p
  block_start_B = rows.prompt_len_B + start_B
  cur_BP = row_slices(st.tokens_BR, start_B, p, alone)
  cur_pos_BP = row_slices(rows.gen_pos_BR, start_B, p, alone)
  prev_BP = row_slices(st.tokens_BR, start_B - p, p, alone)
  prev_pos_BP = row_slices(rows.gen_pos_BR, start_B - p, p, alone)
  if not alone:  # lockstep: every row starts its block
    meta = decode_meta(
      jnp.concatenate([prev_pos_BP, cur_pos_BP], axis=1),
      jnp.ones((b, 2 * p), jnp.int32),
      block_start_B,
      num_clean=p,
    )
    tokens_BT = jnp.concatenate([prev_BP, cur_BP], axis=1)
    logits_BPV, cache = forward(tokens_BT, meta, st.cache, last=p)
    return logits_BPV, cache.replace(end=cache.end + p), st.wide_forwards + 1
  starts_B = st.fresh & ~st.done_B
  s_BT = starts_B[:, None]
  zeros_BP = jnp.zeros_like(cur_BP)
  pads_BP = jnp.full_like(cur_BP, s.pad_id)
  meta = TokenMeta(
    segment_ids=jnp.concatenate([ones_BP, jnp.where(s_BT, ones_BP, zeros_BP)], axis=1),
    positions=jnp.where(
      s_BT,
      jnp.concatenate([prev_pos_BP, cur_pos_BP], axis=1),
      jnp.concatenate([cur_pos_BP, zeros_BP], axis=1),
    ),
    is_block=jnp.concatenate([jnp.broadcast_to(~s_BT, (b, p)), ones_BP > 0], axis=1),
    block_start=jnp.broadcast_to(block_start_B[:, None], (b, 2 * p)),
  )
  tokens_BT = jnp.where(
    s_BT, jnp.concatenate([prev_BP, cur_BP], axis=1), jnp.concatenate([cur_BP, pads_BP], axis=1)
  )
  logits_BPV, cache = forward(tokens_BT, meta, st.cache, last=p, first_B=~starts_B)
  end = cache.end + p * starts_B.astype(jnp.int32)
  return logits_BPV, cache.replace(end=end), st.wide_forwards + 1


def _later_pass(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings, alone: bool):
  """[current block]: P tokens over the cache."""
  p = s.block_size
  start_B = st.index * p
  tokens_BP = row_slices(st.tokens_BR, start_B, p, alone)
  pos_BP = row_slices(rows.gen_pos_BR, start_B, p, alone)
  meta = decode_meta(pos_BP, jnp.ones_like(tokens_BP), rows.prompt_len_B + start_B, num_clean=0)
  return *forward(tokens_BP, meta, st.cache), st.wide_forwards


def prefill(st, prompt_BQ, rows: RowLayout, forward, s, gamma, active_B, alone) -> DecodeState:
  """Each row's first forward over an empty cache. NTP: the prompt, which yields the first
  token. SBD (fused): [prompt (causal) ; P masks], which prefills the cache and is the first
  pass of block 0."""
  b, l = prompt_BQ.shape
  seg_BQ, pos_BQ = prompt_meta(rows.prompt_len_B, l)
  if s.mode == "ntp":
    logits_B1V, cache = forward(prompt_BQ, TokenMeta.causal(seg_BQ, pos_BQ), st.cache, last=1)
    end = jnp.full(jnp.shape(st.index), l, jnp.int32)
    return ntp_record(st.replace(cache=cache.replace(end=end)), logits_B1V[:, 0], s)
  p = s.block_size
  meta = decode_meta(
    jnp.concatenate([pos_BQ, rows.gen_pos_BR[:, :p]], axis=1),
    jnp.concatenate([seg_BQ, jnp.ones((b, p), jnp.int32)], axis=1),
    rows.prompt_len_B,
    num_clean=l,
  )
  masks_BP = jnp.full((b, p), s.mask_id, jnp.int32)
  tokens_BT = jnp.concatenate([prompt_BQ, masks_BP], axis=1)
  logits_BPV, cache = forward(tokens_BT, meta, st.cache, last=p)
  end = jnp.full((b,) if alone else (), l, jnp.int32)  # per-row cache offsets when rows move alone
  st = st.replace(cache=cache.replace(end=end))
  return sbd_reveal(st, logits_BPV, active_B, s, gamma, alone)


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

  def step(pass_fn):
    def body(st: DecodeState) -> DecodeState:
      logits_BPV, cache, wide = pass_fn(st, rows, forward, s, alone)
      st = st.replace(cache=cache, wide_forwards=wide)
      return sbd_reveal(st, logits_BPV, active_B, s, gamma, alone)

    return body

  def some_row_starts(st: DecodeState) -> jax.Array:
    return jnp.any(st.fresh & ~st.done_B)

  if st.tokens_BR.shape[1] == s.block_size:  # a single block: the prefill was its first pass
    return jax.lax.while_loop(go, step(_later_pass), st)

  # One forward per step: wide forwards while some row starts a block, later passes while none
  # does. Two inner loops rather than `lax.cond`: a conditional whose branches update the KV
  # cache in place gets copies of the whole cache on this path (into the branch and out of it,
  # every forward); a while loop updates its carry in place.
  def blocks(st: DecodeState) -> DecodeState:
    st = jax.lax.while_loop(lambda st: some_row_starts(st) & go(st), step(_wide_pass), st)
    return jax.lax.while_loop(lambda st: ~some_row_starts(st) & go(st), step(_later_pass), st)

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
):
  """Decode a whole batch on device (paper Algorithm 3): the prefill, then forwards and
  reveals until every row is done. Returns the final `DecodeState`."""
  s = settings
  b, l = prompt_BQ.shape
  alone = s.rows_move_alone(b)
  if cache_length < s.cache_slots(l, b):
    raise ValueError(f"cache_length {cache_length} < the {s.cache_slots(l, b)} slots needed")
  # Heads-first on TPU (the layout attention reads there: see sbd_jax.model).
  cache = KVCache.empty(model_cfg, b, cache_length, heads_first=platform(mesh) == "tpu")
  st = initial_state(s, cache, key_B, ~active_B, row_index=s.mode == "sbd")
  rows = RowLayout.of(prompt_len_B, s.response_slots)
  forward = functools.partial(model_forward, graphdef, state, mesh=mesh)
  st = prefill(st, prompt_BQ, rows, forward, s, gamma, active_B, alone)
  return decode_while(st, rows, forward, s, gamma, active_B, alone, _running)
