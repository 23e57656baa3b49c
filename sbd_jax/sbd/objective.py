"""The SBD training objective: NTP on the clean half plus MATP on masked block tokens.

Two logit alignments, named explicitly:
* NTP  (shifted):        logits at clean position t predict token t + 1 of the same document.
* MATP (same position):  logits at block position i predict the original token i.

Both cross-entropies are summed over tokens and divided by ONE shared count (the number of
NTP targets), so the two terms keep the paper's relative weight (eq. 14); `matp_weight`
scales the MATP term for models whose masked prediction lags (1 = the paper). Loss masks (e.g.
prompt tokens in SFT data) apply to both terms, and loss-masked tokens stay clean in x̂ (a prompt
is never masked at inference either).

Noising (paper Algorithm 1, per document): η ~ U(0, 1) (or Beta(a, b)) per document, each
maskable token masked with probability η; optionally a share of blocks masked whole, since
every decoded block starts fully masked while U(0, 1) rarely masks a whole block (E[η^k]).

Past the end of a document. A decoded block often runs past the answer's EOS; those block
positions are masked positions of the same sequence. The data pipeline appends `eos_tail`
extra EOS tokens to every document (batch field `eos_tail`, 1 on them): they carry no NTP
target, and in x̂ the ones inside the block holding the document's EOS are MATP targets (EOS),
exactly what decoding meets there. Later blocks of the tail have no target.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from sbd_jax.attention.chunked import NO_SEGMENT, TokenMeta
from sbd_jax.sbd.cross_entropy import chunked_cross_entropy, dense_cross_entropy
from sbd_jax.sbd.masks import block_starts, sbd_training_meta

MODES = ("sbd", "ntp", "matp_only")
ANCHORS = ("document", "completion", "row")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Static settings of the objective (hashable: part of the compiled step)."""

  mode: str = "sbd"  # "sbd" (NTP + MATP), "ntp" (plain LM baseline), "matp_only" (ablation)
  mask_id: int = 0
  k_min: int = 2  # block size drawn per step from U{k_min .. k_max}
  k_max: int = 16
  eta_beta: tuple[float, float] = (1.0, 1.0)  # η ~ Beta(a, b) per document; (1, 1) = U(0, 1)
  full_block_prob: float = 0.0  # probability that a block is masked whole, on top of η
  # Blocks tile each document from its start (the paper), from its completion's start, or the
  # packed row ("row": a static mask for splash attention; documents cut their edge blocks).
  block_anchor: str = "document"
  loss_chunk: int = 0  # tokens per cross-entropy chunk (sbd_jax.cross_entropy); 0 = whole
  matp_weight: float = 1.0  # MATP term's weight in the loss; 1 = the paper's eq. 14

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"sbd.mode must be one of {MODES}, got {self.mode!r}")
    if not 1 <= self.k_min <= self.k_max:
      raise ValueError(
        f"sbd block sizes need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}"
      )
    if len(self.eta_beta) != 2 or min(self.eta_beta) <= 0:
      raise ValueError(f"sbd.eta_beta must be two positive numbers, got {self.eta_beta}")
    if not 0 <= self.full_block_prob <= 1:
      raise ValueError(f"sbd.full_block_prob must be in [0, 1], got {self.full_block_prob}")
    if self.block_anchor not in ANCHORS:
      raise ValueError(f"sbd.block_anchor must be one of {ANCHORS}, got {self.block_anchor!r}")
    if self.loss_chunk < 0:
      raise ValueError(f"train.loss_chunk must be >= 0, got {self.loss_chunk}")
    if not self.matp_weight > 0:
      raise ValueError(f"sbd.matp_weight must be > 0, got {self.matp_weight}")


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
  cfg: ObjectiveConfig,
) -> jax.Array:
  """η per document (Beta(a, b), by default U(0, 1)); each token masked with probability η;
  then each block masked whole with probability cfg.full_block_prob."""
  eta_rng, token_rng, block_rng = jax.random.split(rng, 3)
  shape = segment_ids_BL.shape
  per_document = (shape[0], shape[1] + 1)  # one draw per (row, segment id 0..L)
  a, b = cfg.eta_beta
  if (a, b) == (1.0, 1.0):
    eta_BS = jax.random.uniform(eta_rng, per_document)
  else:
    eta_BS = jax.random.beta(eta_rng, a, b, per_document)
  eta_BL = jnp.take_along_axis(eta_BS, segment_ids_BL, axis=1)
  masked_BL = jax.random.uniform(token_rng, shape) < eta_BL
  if cfg.full_block_prob > 0:
    # One draw per block, read at the block's first token (clamped to the document start).
    index_BL = jnp.arange(shape[1]) - (positions_BL - jnp.maximum(block_start_BL, 0))
    u_BL = jnp.take_along_axis(jax.random.uniform(block_rng, shape), index_BL, axis=1)
    masked_BL = masked_BL | (u_BL < cfg.full_block_prob)
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
) -> SBDBatch:
  """The 2L input [x ; x̂]: x̂ = `mask_id` where masked and maskable, x elsewhere.

  Maskable: loss-bearing tokens, and appended EOS tokens in their document's EOS block.
  """
  if eos_tail_BL is None:
    eos_tail_BL = jnp.zeros_like(tokens_BL)
  targets, weights = ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL)
  meta = sbd_training_meta(segment_ids_BL, positions_BL, block_size, anchors_BL, max_block_size)
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


def sample_block_size(rng: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """k ~ U{k_min .. k_max}, a traced scalar (no recompilation when it changes)."""
  return jax.random.randint(rng, (), cfg.k_min, cfg.k_max + 1)


def make_batch(batch: dict, rng: jax.Array, cfg: ObjectiveConfig) -> tuple[SBDBatch, jax.Array]:
  """Data batch -> objective inputs and k. Fields: tokens, segment_ids, positions, loss_mask
  and (optional, zeros if absent) eos_tail, each [B, L]."""
  tokens, segs, pos, loss_mask = (
    batch["tokens"],
    batch["segment_ids"],
    batch["positions"],
    batch["loss_mask"],
  )
  if cfg.mode == "ntp":
    return build_ntp_batch(tokens, segs, pos, loss_mask), jnp.zeros((), jnp.int32)
  k_rng, mask_rng = jax.random.split(rng)
  block_size = sample_block_size(k_rng, cfg)
  if cfg.block_anchor == "completion":
    anchors = completion_anchors(pos, segs, loss_mask)
  elif cfg.block_anchor == "row":
    anchors = pos - jnp.arange(pos.shape[1], dtype=pos.dtype)  # block starts at row i - i mod k
  else:
    anchors = 0
  masked = draw_masked_positions(mask_rng, segs, pos, block_starts(pos, block_size, anchors), cfg)
  sbd = build_sbd_batch(
    tokens,
    segs,
    pos,
    loss_mask,
    masked,
    block_size,
    cfg.mask_id,
    eos_tail_BL=batch.get("eos_tail"),
    anchors_BL=anchors,
    max_block_size=cfg.k_max,
  )
  return sbd, block_size


def labels(sbd: SBDBatch, mode: str) -> jax.Array:
  """[B, T] label per model position: NTP targets on the clean half, MATP on the block half."""
  if mode == "ntp":
    return sbd.ntp_targets
  return jnp.concatenate([sbd.ntp_targets, sbd.matp_targets], axis=1)


def loss_from_token_ce(ce_BT: jax.Array, sbd: SBDBatch, mode: str, matp_weight: float = 1.0):
  """Scalar loss and metrics from per-position cross-entropy (clean half first, block after)."""
  seq_len = sbd.ntp_targets.shape[1]
  ntp_sum = jnp.sum(ce_BT[:, :seq_len] * sbd.ntp_weights)
  count = jnp.maximum(jnp.sum(sbd.ntp_weights), 1.0)
  if mode == "ntp":
    matp_sum, matp_count = jnp.zeros(()), jnp.zeros(())
  else:
    matp_sum, matp_count = jnp.sum(ce_BT[:, seq_len:] * sbd.matp_weights), jnp.sum(sbd.matp_weights)
  ntp_term = jnp.zeros(()) if mode == "matp_only" else ntp_sum
  loss = (ntp_term + matp_weight * matp_sum) / count
  metrics = {
    "loss": loss,
    "ntp_loss": ntp_sum / count,  # per NTP target
    "matp_loss": matp_sum / count,  # the MATP term as it enters the loss, before matp_weight
    "matp_loss_per_masked": matp_sum / jnp.maximum(matp_count, 1.0),
    "ntp_tokens": jnp.sum(sbd.ntp_weights),
    "masked_tokens": matp_count,
  }
  return loss, metrics


def loss_from_logits(logits_BTV: jax.Array, sbd: SBDBatch, mode: str):
  """Scalar loss and metrics. Logits of the clean half come first, the block half after."""
  return loss_from_token_ce(dense_cross_entropy(logits_BTV, labels(sbd, mode)), sbd, mode)


def loss_fn(model, batch: dict, rng: jax.Array, cfg: ObjectiveConfig):
  """Build the objective's inputs, run the model once over them, return (loss, metrics).
  With cfg.loss_chunk the [T, V] logits are never materialised whole."""
  sbd, block_size = make_batch(batch, rng, cfg)
  features_BTD, _ = model.features(sbd.inputs, sbd.meta)
  targets_BT = labels(sbd, cfg.mode)
  if cfg.loss_chunk:
    ce_BT = chunked_cross_entropy(model.logits, features_BTD, targets_BT, cfg.loss_chunk)
  else:
    ce_BT = dense_cross_entropy(model.logits(features_BTD), targets_BT)
  loss, metrics = loss_from_token_ce(ce_BT, sbd, cfg.mode, cfg.matp_weight)
  return loss, {**metrics, "block_size": block_size.astype(jnp.float32)}
