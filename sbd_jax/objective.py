"""The SBD training objective: NTP on the clean half plus MATP on masked block tokens.

Two logit alignments, named explicitly:
* NTP  (shifted):        logits at clean position t predict token t + 1 of the same document.
* MATP (same position):  logits at block position i predict the original token i.

Both cross-entropies are summed over tokens and divided by ONE shared count (the number of
NTP targets), so the two terms keep the paper's relative weight (eq. 14, no extra
hyperparameter). Loss masks (e.g. prompt tokens in SFT data) apply to both terms.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from sbd_jax.attention import NO_SEGMENT, TokenMeta
from sbd_jax.masks import sbd_training_meta

MODES = ("sbd", "ntp", "matp_only")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Static settings of the objective (hashable: part of the compiled step)."""

  mode: str = "sbd"  # "sbd" (NTP + MATP), "ntp" (plain LM baseline), "matp_only" (ablation)
  mask_id: int = 0
  k_min: int = 2  # block size drawn per step from U{k_min .. k_max}
  k_max: int = 16

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"sbd.mode must be one of {MODES}, got {self.mode!r}")
    if not 1 <= self.k_min <= self.k_max:
      raise ValueError(
        f"sbd block sizes need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}"
      )


@flax.struct.dataclass
class SBDBatch:
  """Model inputs and per-token targets of one objective evaluation."""

  inputs: jax.Array  # [B, T] int32; T = 2L for SBD, L for NTP
  meta: TokenMeta  # [B, T]
  ntp_targets: jax.Array  # [B, L] token at t + 1 (shifted)
  ntp_weights: jax.Array  # [B, L] float32
  matp_targets: jax.Array  # [B, L] original token at t (same position)
  matp_weights: jax.Array  # [B, L] float32: 1 on masked, loss-masked-in positions


def ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL):
  """Shifted targets: token t + 1 when it belongs to the same (non-padding) document."""
  next_tokens = jnp.pad(tokens_BL[:, 1:], ((0, 0), (0, 1)))
  next_segment = jnp.pad(segment_ids_BL[:, 1:], ((0, 0), (0, 1)), constant_values=NO_SEGMENT)
  next_loss = jnp.pad(loss_mask_BL[:, 1:], ((0, 0), (0, 1)))
  valid = (segment_ids_BL == next_segment) & (segment_ids_BL != NO_SEGMENT)
  return next_tokens, valid.astype(jnp.float32) * next_loss.astype(jnp.float32)


def draw_masked_positions(rng: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """Per sequence η ~ U(0, 1); each token is masked independently with probability η."""
  eta_rng, token_rng = jax.random.split(rng)
  eta_B1 = jax.random.uniform(eta_rng, (shape[0], 1))
  return jax.random.uniform(token_rng, shape) < eta_B1


def build_sbd_batch(
  tokens_BL, segment_ids_BL, positions_BL, loss_mask_BL, masked_BL, block_size, mask_id: int
) -> SBDBatch:
  """The 2L input [x ; x̂] with x̂ = x where not masked, `mask_id` where masked."""
  targets, weights = ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL)
  real = segment_ids_BL != NO_SEGMENT
  masked_BL = masked_BL & real
  noised_BL = jnp.where(masked_BL, mask_id, tokens_BL)
  return SBDBatch(
    inputs=jnp.concatenate([tokens_BL, noised_BL], axis=1).astype(jnp.int32),
    meta=sbd_training_meta(segment_ids_BL, positions_BL, block_size),
    ntp_targets=targets,
    ntp_weights=weights,
    matp_targets=tokens_BL,
    matp_weights=masked_BL.astype(jnp.float32) * loss_mask_BL.astype(jnp.float32),
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
  """Data batch (tokens, segment_ids, positions, loss_mask) -> objective inputs and k."""
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
  masked = draw_masked_positions(mask_rng, tokens.shape)
  return build_sbd_batch(tokens, segs, pos, loss_mask, masked, block_size, cfg.mask_id), block_size


def loss_from_logits(logits_BTV: jax.Array, sbd: SBDBatch, mode: str):
  """Scalar loss and metrics. Logits of the clean half come first, the block half after."""
  seq_len = sbd.ntp_targets.shape[1]
  logits = logits_BTV.astype(jnp.float32)
  ntp_ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :seq_len], sbd.ntp_targets)
  ntp_sum = jnp.sum(ntp_ce * sbd.ntp_weights)
  count = jnp.maximum(jnp.sum(sbd.ntp_weights), 1.0)
  if mode == "ntp":
    matp_sum, matp_count = jnp.zeros(()), jnp.zeros(())
  else:
    matp_ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, seq_len:], sbd.matp_targets)
    matp_sum, matp_count = jnp.sum(matp_ce * sbd.matp_weights), jnp.sum(sbd.matp_weights)
  ntp_term = jnp.zeros(()) if mode == "matp_only" else ntp_sum
  loss = (ntp_term + matp_sum) / count
  metrics = {
    "loss": loss,
    "ntp_loss": ntp_sum / count,  # per NTP target
    "matp_loss": matp_sum / count,  # the MATP term as it enters the loss
    "matp_loss_per_masked": matp_sum / jnp.maximum(matp_count, 1.0),
    "ntp_tokens": jnp.sum(sbd.ntp_weights),
    "masked_tokens": matp_count,
  }
  return loss, metrics


def loss_fn(model: Callable, batch: dict, rng: jax.Array, cfg: ObjectiveConfig):
  """Build the objective's inputs, run the model once over them, return (loss, metrics)."""
  sbd, block_size = make_batch(batch, rng, cfg)
  logits, _ = model(sbd.inputs, sbd.meta)
  loss, metrics = loss_from_logits(logits, sbd, cfg.mode)
  return loss, {**metrics, "block_size": block_size.astype(jnp.float32)}
