"""The on-device decode: KV-cached Set Block Decoding (paper Algorithm 3) and next-token
decoding of a whole batch in one jitted `lax.while_loop`. Host-side batching is in `sampler`;
a queue of prompts through one set of rows, finished rows refilled, is in `decode_queue`, which
reuses the pieces here (`prefill`, `decode_while`).

Dimension letters (docs/dimensions.md): B batch, Q prompt slots (a length bucket), T new tokens
of one forward, S cache slots, V vocabulary, P block positions (the SBD block size k), R response
slots (max_new_tokens, rounded up to a multiple of P for SBD).

Layout. Prompts are left-padded to a bucket L, so the prompt ends at slot L in every row: pad
slots get segment 0 (invisible), real tokens segment 1 with positions 0, 1, ... from the first
real token. Generated token r has position prompt_len + r; the cache commits a row's blocks in
order after its prompt.

Forwards (SBD, paper Algorithms 2-3). The first forward is fused: [prompt (causal) ; P masks]
prefills the cache and is the first pass of block 0. The first pass of block j >= 1 is
[block j-1 (causal, committed to the cache) ; block j] (2P tokens, a "wide" forward); later
passes are the P block tokens alone. After each forward a reveal rule (`reveal_rules`) fills
some masked positions. NTP uses the same cache code: the prefill forward yields the first
token, then one token per forward.

Rows of a batch move through their blocks alone: a row whose block is complete starts its next
block in the next forward, whatever the other rows do. A forward is wide when some row starts a
block; the other rows send their block followed by P placeholder tokens (segment 0: they see
and are seen by nothing), and each row writes at its own cache offset (a scatter). In
lockstep (`lockstep=True`) the batch instead waits at every block for its slowest row: one
cache offset for the batch (a dynamic-update-slice), a wide forward only when all rows start a
block together. A single row is the same either way, and so are every row's tokens, reveal
steps and NFE. On TPU the cache is stored heads-first (`KVCache.heads_first`), the layout in
which the per-row write needs no copy of the cache (sbd_jax.model).

Accounting. A sequence's NFE counts the forwards in which it still had a masked position and
was not finished, so it equals the forwards it would need decoded alone. A sequence is done
once an EOS is revealed with no masked position before it in the block (tokens after it are
dropped), or at max_new_tokens. `reveal_step` holds, per generated token, the sequence's own
forward index (1-based) at which it was revealed. The batch counts its own forwards, and of
them the wide ones after the prefill.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbd_jax import sharding
from sbd_jax.attention.chunked import TokenMeta
from sbd_jax.model.transformer import KVCache
from sbd_jax.sbd import reveal_rules
from sbd_jax.sbd.masks import decode_meta

MODES = ("sbd", "ntp")


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """Hashable decode settings: one compilation per (settings, bucket, batch size). `gamma`
  alone enters the compiled loop as a traced value, so a γ sweep compiles once."""

  eos_id: int  # -1: no EOS, every row decodes max_new_tokens (for timing)
  mask_id: int
  pad_id: int
  mode: str = "sbd"  # "sbd" (set block decoding) or "ntp" (next-token baseline)
  block_size: int = 16  # P, SBD only
  rule: str = "eb_entropy"  # a name in reveal_rules.RULES, SBD only
  gamma: float = 0.35  # γ of the EB rules / f of the factor rule; 0 = one token per forward
  temperature: float = 0.0  # 0 = argmax; > 0 samples softmax(logits / temperature)
  max_new_tokens: int = 256
  # SBD batches. True: the batch moves to its next block only when every row has completed
  # the current one. False: each row moves on alone (module docstring).
  lockstep: bool = False
  # Batches of a decode queue (`decode_queue`): True, a finished row takes the next prompt at
  # once (continuous batching); False, each batch decodes until its last row is done.
  refill: bool = False
  # With refill: how many finished rows are refilled together, in one prefill forward. A refill
  # waits until that many rows are done (fewer at the end of the queue).
  refill_rows: int = 1

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"unknown decode mode {self.mode!r}; choose one of {MODES}")
    if self.block_size < 1:
      raise ValueError(f"block_size must be >= 1, got {self.block_size}")
    if self.gamma < 0:
      raise ValueError(f"gamma must be >= 0, got {self.gamma}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.lockstep not in (True, False):
      raise ValueError(f"lockstep must be True or False, got {self.lockstep!r}")
    if self.refill not in (True, False):
      raise ValueError(f"refill must be True or False, got {self.refill!r}")
    if self.refill_rows < 1:
      raise ValueError(f"refill_rows must be >= 1, got {self.refill_rows}")
    if self.refill_rows != 1 and not self.refill:
      raise ValueError(
        f"refill_rows={self.refill_rows} applies to refill: set refill=True (--refill)"
      )
    if self.refill and self.lockstep:
      raise ValueError("refill needs rows that move alone: set lockstep=False")
    reveal_rules.get_rule(self.rule)
    if self.mask_id in (self.eos_id, self.pad_id):
      raise ValueError(f"mask_id {self.mask_id} must differ from eos_id and pad_id")

  @property
  def response_slots(self) -> int:
    """R: generated-token slots (max_new_tokens, rounded up to whole blocks for SBD)."""
    if self.mode == "ntp":
      return self.max_new_tokens
    return -(-self.max_new_tokens // self.block_size) * self.block_size

  def rows_move_alone(self, rows: int) -> bool:
    """Whether the rows of a `rows`-row batch move through their SBD blocks alone (with refill
    even one row does: its prompts start at their own offsets)."""
    return self.mode == "sbd" and (rows > 1 or self.refill) and not self.lockstep

  def cache_slots(self, bucket: int, rows: int) -> int:
    """KV-cache slots a decode of `rows` rows needs after a prompt bucket of `bucket` slots:
    the response slots, plus one block where rows may move alone (a row that does not start a
    block in a wide forward writes P placeholders after its block)."""
    spare = self.block_size if self.rows_move_alone(rows) else 0
    return bucket + self.response_slots + spare

  def replace(self, **changes: Any) -> "SamplerSettings":
    return dataclasses.replace(self, **changes)


@flax.struct.dataclass
class DecodeState:
  """Loop carry. `index` is each row's current block [B] (SBD; equal across rows in lockstep)
  or the next token slot (NTP, a scalar)."""

  tokens_BR: jax.Array  # generated tokens; mask_id where not (yet) revealed
  reveal_step_BR: jax.Array  # the sequence's forward index (1-based) that revealed each token
  nfe_B: jax.Array  # forwards counted per sequence
  length_B: jax.Array  # generated tokens kept (incl. EOS); valid once done
  done_B: jax.Array
  index: jax.Array  # int32, [B] (SBD) or scalar (NTP)
  fresh: jax.Array  # bool [B]: the row's next forward is the first pass of its block `index`
  forwards: jax.Array  # int32 scalar: forwards the batch has run, the prefill included
  wide_forwards: jax.Array  # int32 scalar: of those, 2P-token forwards after the prefill
  cache: KVCache
  key_B: jax.Array  # typed PRNG key per row: its prompt's (`prompt_keys`)


# ------------------------------------------------------------------------------------------
# Pieces of the jitted decode.


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


def prompt_keys(seed: jax.Array, prompt_B: jax.Array) -> jax.Array:
  """Each prompt's PRNG key, fold_in(key(seed), its index among the prompts decoded): a
  prompt's samples then depend on the seed and the prompt alone, not on its batch or queue."""
  return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), prompt_B)


def _pick(logits_BTV: jax.Array, st: DecodeState, s: SamplerSettings):
  """Mask logit -> -inf (before anything else), then (tokens [B, T], logp [B, T, V]). With a
  temperature, row b draws with fold_in(st.key_B[b], its NFE so far): one fresh key per forward
  the row counts. Greedy decoding draws nothing (no threefry hash per forward)."""
  # A select over the vocabulary fuses into the consumers below. `.at[..., mask_id].set` is a
  # scatter: XLA wrote the f32 logits out for it at every forward (on TPU, 2-layer llama8b on
  # v5p-8: 1.3 % of the decode's bytes), and XLA:CPU copied them twice first.
  is_mask_V = jnp.arange(logits_BTV.shape[-1]) == s.mask_id
  logits = jnp.where(is_mask_V, -jnp.inf, logits_BTV.astype(jnp.float32))
  if s.temperature > 0:
    logits = logits / s.temperature
    keys_B = jax.vmap(jax.random.fold_in)(st.key_B, st.nfe_B)
    tokens = jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys_B, logits)
  else:
    tokens = _argmax(logits)
  return tokens.astype(jnp.int32), jax.nn.log_softmax(logits, axis=-1)


def _argmax(x_BTV: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis (the first index of the maximum) as two plain reductions.
  argmax lowers to one (value, index) reduction, which XLA's CPU backend does not vectorise:
  18 µs against 4 µs for a 16 x 384 block, 144 µs against 17 µs for one row of 32768 (in a
  jitted loop on the 2-core CPU). NaN logits give the last id (argmax: the first NaN's)."""
  v = x_BTV.shape[-1]
  top = jnp.max(x_BTV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(x_BTV == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(first, v - 1)


def _row_slices(x_BR: jax.Array, start_B: jax.Array, size: int, alone: bool) -> jax.Array:
  """x[b, start_B[b] : start_B[b] + size] for every row [B, size] (starts clamped into range).
  Rows that do not move alone share one start, read as one dynamic slice."""
  if not alone:
    return jax.lax.dynamic_slice_in_dim(x_BR, start_B[0], size, axis=1)
  return jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, size))(x_BR, start_B)


def _row_updates(x_BR: jax.Array, new_BP: jax.Array, start_B: jax.Array, alone: bool):
  """x with x[b, start_B[b] : start_B[b] + P] = new_BP[b] (the inverse of `_row_slices`)."""
  if not alone:
    return jax.lax.dynamic_update_slice_in_dim(x_BR, new_BP, start_B[0], axis=1)
  update = lambda x, new, s: jax.lax.dynamic_update_slice_in_dim(x, new, s, axis=0)  # noqa: E731
  return jax.vmap(update)(x_BR, new_BP, start_B)


def _sbd_reveal(
  st: DecodeState,
  logits_BPV: jax.Array,
  active_B: jax.Array,
  s: SamplerSettings,
  gamma: jax.Array,
  alone: bool,
) -> DecodeState:
  """Reveal masked positions of each row's block `st.index`, update done/NFE, and move rows
  whose block is complete (`alone`; else all rows, once every block is) to their next block."""
  b = logits_BPV.shape[0]
  p = s.block_size
  start_B = st.index * p
  block_BP = _row_slices(st.tokens_BR, start_B, p, alone)
  steps_BP = _row_slices(st.reveal_step_BR, start_B, p, alone)
  in_range_BP = start_B[:, None] + jnp.arange(p) < s.max_new_tokens
  open_BP = (block_BP == s.mask_id) & in_range_BP & ~st.done_B[:, None] & active_B[:, None]

  sampled_BP, logp_BPV = _pick(logits_BPV, st, s)
  reveal_BP = reveal_rules.get_rule(s.rule)(logp_BPV, open_BP, gamma) & open_BP
  live_B = jnp.any(open_BP, axis=-1)
  nfe_B = st.nfe_B + live_B.astype(jnp.int32)
  block_BP = jnp.where(reveal_BP, sampled_BP, block_BP)
  steps_BP = jnp.where(reveal_BP, nfe_B[:, None], steps_BP)

  # The first EOS of the block, p if none, as one plain min-reduction (argmax is a (value,
  # index) reduction, and `any` for "has an EOS" would be another). Each reduction over the
  # block is a kernel of its own at every forward; the EOS bookkeeping below needs two.
  position_P = jnp.arange(p)
  first_eos_B = jnp.min(jnp.where((block_BP == s.eos_id) & in_range_BP, position_P, p), axis=-1)
  # Positions after the first EOS are past the answer: they hold EOS (what training shows
  # there) and are never decoded, so no forward is spent on them.
  block_BP = jnp.where(position_P > first_eos_B[:, None], s.eos_id, block_BP)
  # Positions still masked before the first EOS (anywhere, without one). The EOS's own
  # position is not among them (it holds the EOS), so these are all the positions left open.
  waiting_B = jnp.any(open_BP & ~reveal_BP & (position_P < first_eos_B[:, None]), axis=-1)
  newly_done_B = live_B & (first_eos_B < p) & ~waiting_B
  length_B = jnp.where(newly_done_B, start_B + first_eos_B + 1, st.length_B)
  done_B = st.done_B | newly_done_B

  complete_B = done_B | ~waiting_B
  if alone:  # a row finished earlier stays where it is
    advance_B = complete_B & ~st.done_B
  else:
    advance_B = jnp.broadcast_to(jnp.all(complete_B), (b,))
  index_B = st.index + advance_B.astype(jnp.int32)
  exhausted_B = index_B * p >= s.max_new_tokens
  length_B = jnp.where(exhausted_B & ~done_B, s.max_new_tokens, length_B)
  return st.replace(
    tokens_BR=_row_updates(st.tokens_BR, block_BP, start_B, alone),
    reveal_step_BR=_row_updates(st.reveal_step_BR, steps_BP, start_B, alone),
    nfe_B=nfe_B,
    length_B=length_B,
    done_B=done_B | exhausted_B,
    index=index_B,
    fresh=advance_B,
    forwards=st.forwards + 1,
  )


def _ntp_record(st: DecodeState, logits_BV: jax.Array, s: SamplerSettings) -> DecodeState:
  """Sample token `st.index` (one slot for the batch, or one per row) of unfinished sequences
  from the last position's logits."""
  token_B, _ = _pick(logits_BV, st, s)
  live_B = ~st.done_B
  nfe_B = st.nfe_B + live_B.astype(jnp.int32)
  g = st.index
  if jnp.ndim(g) == 0:
    read = lambda x_BR: jax.lax.dynamic_index_in_dim(x_BR, g, axis=1, keepdims=False)  # noqa: E731
    write = lambda x_BR, new_B: jax.lax.dynamic_update_index_in_dim(x_BR, new_B, g, axis=1)  # noqa: E731
    index = g + 1
  else:  # a finished row stays at its slot (clamped into range once past the last)
    read = lambda x_BR: _row_slices(x_BR, g, 1, alone=True)[:, 0]  # noqa: E731
    write = lambda x_BR, new_B: _row_updates(x_BR, new_B[:, None], g, alone=True)  # noqa: E731
    index = g + live_B.astype(jnp.int32)
  token_B = jnp.where(live_B, token_B, read(st.tokens_BR))
  step_B = jnp.where(live_B, nfe_B, read(st.reveal_step_BR))
  newly_done_B = live_B & (token_B == s.eos_id)
  length_B = jnp.where(newly_done_B, g + 1, st.length_B)
  exhausted = index >= s.max_new_tokens
  length_B = jnp.where(exhausted & ~(st.done_B | newly_done_B), s.max_new_tokens, length_B)
  return st.replace(
    tokens_BR=write(st.tokens_BR, token_B),
    reveal_step_BR=write(st.reveal_step_BR, step_B),
    nfe_B=nfe_B,
    length_B=length_B,
    done_B=st.done_B | newly_done_B | exhausted,
    index=index,
    forwards=st.forwards + 1,
  )


class RowLayout(NamedTuple):
  """Where each row's tokens sit: its prompt length and its generated tokens' positions."""

  prompt_len_B: jax.Array  # int32 [B]
  gen_pos_BR: jax.Array  # int32 [B, R]: prompt_len + r

  @classmethod
  def of(cls, prompt_len_B: jax.Array, response_slots: int) -> "RowLayout":
    return cls(prompt_len_B, prompt_len_B[:, None] + jnp.arange(response_slots, dtype=jnp.int32))


def _prompt_meta(prompt_len_B: jax.Array, bucket: int) -> tuple[jax.Array, jax.Array]:
  """(segment ids, positions) [B, Q] of left-padded prompts: pad slots get segment 0."""
  slot_Q = jnp.arange(bucket, dtype=jnp.int32)
  first_real_B = bucket - prompt_len_B
  seg_BQ = (slot_Q >= first_real_B[:, None]).astype(jnp.int32)
  return seg_BQ, jnp.maximum(slot_Q - first_real_B[:, None], 0) * seg_BQ


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
  cur_BP = _row_slices(st.tokens_BR, start_B, p, alone)
  cur_pos_BP = _row_slices(rows.gen_pos_BR, start_B, p, alone)
  prev_BP = _row_slices(st.tokens_BR, start_B - p, p, alone)
  prev_pos_BP = _row_slices(rows.gen_pos_BR, start_B - p, p, alone)
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
  tokens_BP = _row_slices(st.tokens_BR, start_B, p, alone)
  pos_BP = _row_slices(rows.gen_pos_BR, start_B, p, alone)
  meta = decode_meta(pos_BP, jnp.ones_like(tokens_BP), rows.prompt_len_B + start_B, num_clean=0)
  return *forward(tokens_BP, meta, st.cache), st.wide_forwards


def initial_state(
  s: SamplerSettings, cache: KVCache, key_B: jax.Array, done_B: jax.Array, row_index: bool
) -> DecodeState:
  """Nothing decoded yet. `row_index`: a block (SBD) or token slot (NTP) index per row, else one
  NTP slot for the batch."""
  b, r = done_B.shape[0], s.response_slots
  return DecodeState(
    tokens_BR=jnp.full((b, r), s.mask_id, jnp.int32),
    reveal_step_BR=jnp.zeros((b, r), jnp.int32),
    nfe_B=jnp.zeros((b,), jnp.int32),
    length_B=jnp.zeros((b,), jnp.int32),
    done_B=done_B,
    index=jnp.zeros((b,) if row_index else (), jnp.int32),
    fresh=jnp.zeros((b,), bool),
    forwards=jnp.zeros((), jnp.int32),
    wide_forwards=jnp.zeros((), jnp.int32),
    cache=cache,
    key_B=key_B,
  )


def prefill(st, prompt_BQ, rows: RowLayout, forward, s, gamma, active_B, alone) -> DecodeState:
  """Each row's first forward over an empty cache. NTP: the prompt, which yields the first
  token. SBD (fused): [prompt (causal) ; P masks], which prefills the cache and is the first
  pass of block 0."""
  b, l = prompt_BQ.shape
  seg_BQ, pos_BQ = _prompt_meta(rows.prompt_len_B, l)
  if s.mode == "ntp":
    logits_B1V, cache = forward(prompt_BQ, TokenMeta.causal(seg_BQ, pos_BQ), st.cache, last=1)
    end = jnp.full(jnp.shape(st.index), l, jnp.int32)
    return _ntp_record(st.replace(cache=cache.replace(end=end)), logits_B1V[:, 0], s)
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
  return _sbd_reveal(st, logits_BPV, active_B, s, gamma, alone)


def _ntp_step(st: DecodeState, rows: RowLayout, forward, s: SamplerSettings) -> DecodeState:
  """One NTP forward: the last sampled token of every row, then the next one sampled."""
  g = st.index
  if jnp.ndim(g) == 0:  # one token slot for the batch
    token_B1 = jax.lax.dynamic_slice_in_dim(st.tokens_BR, g - 1, 1, axis=1)
    pos_B1 = jax.lax.dynamic_slice_in_dim(rows.gen_pos_BR, g - 1, 1, axis=1)
    committed = 1
  else:  # a slot per row: finished rows stay where they are
    token_B1 = _row_slices(st.tokens_BR, g - 1, 1, alone=True)
    pos_B1 = _row_slices(rows.gen_pos_BR, g - 1, 1, alone=True)
    committed = (~st.done_B).astype(jnp.int32)
  meta = TokenMeta.causal(jnp.ones_like(pos_B1), pos_B1)
  logits_B1V, cache = forward(token_B1, meta, st.cache)
  st = st.replace(cache=cache.replace(end=cache.end + committed))
  return _ntp_record(st, logits_B1V[:, 0], s)


def decode_while(st, rows: RowLayout, forward, s, gamma, active_B, alone, go) -> DecodeState:
  """The forwards after the prefill, each followed by its reveal, while `go(st)`."""
  if s.mode == "ntp":
    return jax.lax.while_loop(go, lambda st: _ntp_step(st, rows, forward, s), st)

  def step(pass_fn):
    def body(st: DecodeState) -> DecodeState:
      logits_BPV, cache, wide = pass_fn(st, rows, forward, s, alone)
      st = st.replace(cache=cache, wide_forwards=wide)
      return _sbd_reveal(st, logits_BPV, active_B, s, gamma, alone)

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


def _decode(
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


_TRACES = [0]


@dataclasses.dataclass(frozen=True, eq=False)
class StaticGraph:
  """A model's structure (nnx GraphDef and the weights' treedef) as a jit static argument,
  hashed once rather than on every call: jit hashes static arguments per call, and a GraphDef
  hashes node by node (0.1 ms for the 4-layer tiny model, 0.8 ms at 32 layers on this CPU).
  The weights then travel as a flat list of arrays, which jit flattens in C++; an nnx.State
  argument is flattened in Python (45 µs for the tiny model's 42 leaves, per call)."""

  graphdef: Any
  treedef: Any

  @classmethod
  def of(cls, graphdef, state) -> "StaticGraph":
    return cls(graphdef, jax.tree.structure(state))

  def __post_init__(self):
    object.__setattr__(self, "_hash", hash((self.graphdef, self.treedef)))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, StaticGraph):
      return False
    same = lambda a, b: a is b or a == b  # noqa: E731
    return same(other.graphdef, self.graphdef) and same(other.treedef, self.treedef)

  def state(self, weights: list) -> Any:
    """The nnx.State whose leaves are `weights` (in `jax.tree.leaves` order)."""
    return jax.tree.unflatten(self.treedef, weights)


class BatchResult(NamedTuple):
  """One decode call's results on the host (`unpack`), a row per prompt."""

  tokens_BR: np.ndarray
  reveal_step_BR: np.ndarray
  nfe_B: np.ndarray
  length_B: np.ndarray
  # Forwards spent on the prompt's row while it held the prompt (its prefill included; in a
  # batch, all of the batch's forwards): >= the prompt's NFE. And of them the 2P-token ones.
  row_forwards_B: np.ndarray
  row_wide_forwards_B: np.ndarray
  forwards: int  # every forward of the call, its prefills included
  wide_forwards: int  # of them, SBD's 2P-token forwards
  prefills: int  # of them, prompt forwards: one per batch, or one per prompt of a queue


def pack(st: DecodeState, row_forwards_B, row_wide_forwards_B, forwards, prefills) -> jax.Array:
  """A decode's results as one int32 array [B, 2R + 7] (see `unpack`): one transfer to the
  host, not nine. `st` gives the tokens, reveal steps, NFE, lengths and wide forwards;
  `forwards` counts every forward of the call, `prefills` of them the prompt forwards."""
  b = len(st.nfe_B)
  totals = jnp.stack([jnp.asarray(forwards), st.wide_forwards, jnp.asarray(prefills)])
  per_row = [st.nfe_B, st.length_B, row_forwards_B, row_wide_forwards_B]
  columns = [st.tokens_BR, st.reveal_step_BR, jnp.stack(per_row, axis=1), totals[None]]
  return jnp.concatenate(
    [jnp.broadcast_to(c, (b, c.shape[1])).astype(jnp.int32) for c in columns], axis=1
  )


def unpack(packed_BX: np.ndarray, response_slots: int) -> BatchResult:
  """`pack`'s array [B, 2R + 7] as a `BatchResult`."""
  r = response_slots
  column = lambda i: packed_BX[:, 2 * r + i]  # noqa: E731
  return BatchResult(
    tokens_BR=packed_BX[:, :r],
    reveal_step_BR=packed_BX[:, r : 2 * r],
    nfe_B=column(0),
    length_B=column(1),
    row_forwards_B=column(2),
    row_wide_forwards_B=column(3),
    forwards=int(packed_BX[0, 2 * r + 4]),
    wide_forwards=int(packed_BX[0, 2 * r + 5]),
    prefills=int(packed_BX[0, 2 * r + 6]),
  )


@functools.partial(
  jax.jit, static_argnames=("graph", "settings", "model_cfg", "cache_length", "mesh")
)
def decode_batch(
  graph: StaticGraph,
  weights: list,
  prompt_BQ,
  prompt_len_B,
  active_B,
  seed,
  batch_index,
  gamma,
  *,
  settings,
  model_cfg,
  cache_length,
  mesh,
):
  """`_decode` compiled per (shapes, settings without γ); `gamma` is a traced float32 scalar.
  `batch_index` is the index of the batch's first prompt among all prompts decoded: row b
  draws with `prompt_keys(seed, batch_index + b)`, made on device (no host dispatch).
  Returns `pack`'s one int32 array [B, 2R + 7].
  With a mesh, it comes back replicated on every device."""
  count_compilation()
  key_B = prompt_keys(seed, batch_index + jnp.arange(prompt_BQ.shape[0], dtype=jnp.int32))
  kwargs = dict(settings=settings, model_cfg=model_cfg, cache_length=cache_length, mesh=mesh)
  args = (graph.graphdef, graph.state(weights), prompt_BQ, prompt_len_B, active_B, key_B, gamma)

  def packed():
    st = _decode(*args, **kwargs)
    b = len(st.nfe_B)
    each_row = lambda x: jnp.broadcast_to(x, (b,))  # noqa: E731
    return pack(st, each_row(st.forwards), each_row(st.wide_forwards), st.forwards, 1)

  return on_mesh(packed, mesh)


def on_mesh(compute, mesh):
  """`compute()` traced with the mesh's activation sharding, its (small) result replicated on
  every device, so that each process can read it when the mesh spans hosts (a row-sharded
  result is not addressable from one process). Without a mesh, `compute()`."""
  if mesh is None:
    return compute()
  with sharding.activation_sharding(mesh):
    out = compute()
  return jax.lax.with_sharding_constraint(out, sharding.replicated(mesh))


def count_compilation() -> None:
  """Called from a jitted decode's body: it runs once per trace, i.e. per compilation."""
  _TRACES[0] += 1


def compiled_count() -> int:
  """How many (shape, settings) variants of the decode have been traced (= compiled) here."""
  return _TRACES[0]
