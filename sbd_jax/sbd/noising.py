"""Noising (paper Algorithm 1): the 2L training input [x ; x̂] and both terms' targets.

η ~ U(0, 1) (or Beta(a, b)) per document, each maskable token masked with probability η;
optionally a share of blocks masked whole, since every decoded block starts fully masked while
U(0, 1) rarely masks a whole block (E[η^k]). Loss-masked tokens (e.g. SFT prompts) stay clean in
x̂, as a prompt is never masked at inference either.

Past the end of a document. A decoded block often runs past the answer's EOS; those block
positions are masked positions of the same sequence. The data pipeline appends `eos_tail`
extra EOS tokens to every document (batch field `eos_tail`, 1 on them): they carry no NTP
target, and in x̂ the ones inside the block holding the document's EOS are MATP targets (EOS),
exactly what decoding meets there. Later blocks of the tail have no target.

Dimension letters (docs/dimensions.md): B batch, L row length, T model positions (2L or L).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from sbd_jax.attention.meta import NO_SEGMENT, TokenMeta
from sbd_jax.sbd.masks import sbd_training_meta


@flax.struct.dataclass
class SBDBatch:
  """Model inputs and per-token targets of one objective evaluation."""

  inputs: jax.Array  # [B, T] int32; T = 2L for SBD, L for NTP
  meta: TokenMeta  # [B, T]
  ntp_targets: jax.Array  # [B, L] token at t + 1 (shifted)
  ntp_weights: jax.Array  # [B, L] float32
  matp_targets: jax.Array  # [B, L] original token at t (same position)
  matp_weights: jax.Array  # [B, L] float32: 1 on masked positions that have a target


def ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL):
  """Shifted targets: token t + 1 when it belongs to the same (non-padding) document."""
  next_tokens = jnp.pad(tokens_BL[:, 1:], ((0, 0), (0, 1)))
  next_segment = jnp.pad(segment_ids_BL[:, 1:], ((0, 0), (0, 1)), constant_values=NO_SEGMENT)
  next_loss = jnp.pad(loss_mask_BL[:, 1:], ((0, 0), (0, 1)))
  valid = (segment_ids_BL == next_segment) & (segment_ids_BL != NO_SEGMENT)
  return next_tokens, valid.astype(jnp.float32) * next_loss.astype(jnp.float32)


def segment_min(values_BL: jax.Array, segment_ids_BL: jax.Array) -> jax.Array:
  """Per token, the minimum of `values` over its document (row and segment id)."""
  num_segments = values_BL.shape[1] + 1  # ids 0..L: a row of L tokens has at most L documents

  def one_row(values_L, segments_L):
    return jax.ops.segment_min(values_L, segments_L, num_segments=num_segments)[segments_L]

  return jax.vmap(one_row)(values_BL, segment_ids_BL)


def completion_anchors(positions_BL, segment_ids_BL, loss_mask_BL) -> jax.Array:
  """Position of each document's first loss-bearing token (its completion start)."""
  big = jnp.iinfo(jnp.int32).max
  first = segment_min(jnp.where(loss_mask_BL > 0, positions_BL, big), segment_ids_BL)
  return jnp.where(first == big, 0, first)


def eos_block_tail(positions_BL, segment_ids_BL, eos_tail_BL, block_start_BL) -> jax.Array:
  """True on appended EOS tokens that share a block with their document's own EOS."""
  big = jnp.iinfo(jnp.int32).max
  first_tail = segment_min(jnp.where(eos_tail_BL > 0, positions_BL, big), segment_ids_BL)
  return (eos_tail_BL > 0) & (block_start_BL <= first_tail - 1)


def draw_masked_positions(
  rng: jax.Array,
  segment_ids_BL: jax.Array,
  positions_BL: jax.Array,
  block_start_BL: jax.Array,
  *,
  eta_beta: tuple[float, float] = (1.0, 1.0),
  full_block_prob: float = 0.0,
) -> jax.Array:
  """η per document (Beta(a, b), by default U(0, 1)); each token masked with probability η;
  then each block masked whole with probability `full_block_prob`."""
  eta_rng, token_rng, block_rng = jax.random.split(rng, 3)
  shape = segment_ids_BL.shape
  per_document = (shape[0], shape[1] + 1)  # one draw per (row, segment id 0..L)
  a, b = eta_beta
  if (a, b) == (1.0, 1.0):
    eta_BS = jax.random.uniform(eta_rng, per_document)
  else:
    eta_BS = jax.random.beta(eta_rng, a, b, per_document)
  eta_BL = jnp.take_along_axis(eta_BS, segment_ids_BL, axis=1)
  masked_BL = jax.random.uniform(token_rng, shape) < eta_BL
  if full_block_prob > 0:
    # One draw per block, read at the block's first token (clamped to the document start).
    index_BL = jnp.arange(shape[1]) - (positions_BL - jnp.maximum(block_start_BL, 0))
    u_BL = jnp.take_along_axis(jax.random.uniform(block_rng, shape), index_BL, axis=1)
    masked_BL = masked_BL | (u_BL < full_block_prob)
  return masked_BL


def build_sbd_batch(
  tokens_BL,
  segment_ids_BL,
  positions_BL,
  loss_mask_BL,
  masked_BL,
  block_size,
  mask_id: int,
  *,
  eos_tail_BL=None,
  anchors_BL=0,
  max_block_size: int = 0,
  min_block_size: int = 1,
) -> SBDBatch:
  """The 2L input [x ; x̂]: x̂ = `mask_id` where masked and maskable, x elsewhere.

  Maskable: loss-bearing tokens, and appended EOS tokens in their document's EOS block.
  """
  if eos_tail_BL is None:
    eos_tail_BL = jnp.zeros_like(tokens_BL)
  targets, weights = ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL)
  meta = sbd_training_meta(
    segment_ids_BL, positions_BL, block_size, anchors_BL, max_block_size, min_block_size
  )
  block_start_BL = meta.block_start[:, tokens_BL.shape[1] :]
  tail_targets = eos_block_tail(positions_BL, segment_ids_BL, eos_tail_BL, block_start_BL)
  maskable = ((loss_mask_BL > 0) | tail_targets) & (segment_ids_BL != NO_SEGMENT)
  masked_BL = masked_BL & maskable
  noised_BL = jnp.where(masked_BL, mask_id, tokens_BL)
  return SBDBatch(
    inputs=jnp.concatenate([tokens_BL, noised_BL], axis=1).astype(jnp.int32),
    meta=meta,
    ntp_targets=targets,
    ntp_weights=weights,
    matp_targets=tokens_BL,
    matp_weights=masked_BL.astype(jnp.float32),
  )


def build_ntp_batch(tokens_BL, segment_ids_BL, positions_BL, loss_mask_BL) -> SBDBatch:
  targets, weights = ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL)
  return SBDBatch(
    inputs=tokens_BL.astype(jnp.int32),
    meta=TokenMeta.causal(segment_ids_BL, positions_BL),
    ntp_targets=targets,
    ntp_weights=weights,
    matp_targets=tokens_BL,
    matp_weights=jnp.zeros(tokens_BL.shape, jnp.float32),
  )
