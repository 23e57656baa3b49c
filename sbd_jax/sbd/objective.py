"""The SBD training objective: NTP on the clean half plus MATP on masked block tokens.

Two logit alignments, named explicitly:
* NTP  (shifted):        logits at clean position t predict token t + 1 of the same document.
* MATP (same position):  logits at block position i predict the original token i.

Both cross-entropies are summed over tokens and divided by ONE shared count (the number of
NTP targets), so the two terms keep the paper's relative weight (eq. 14); `matp_weight`
scales the MATP term for models whose masked prediction lags (1 = the paper). Loss masks (e.g.
prompt tokens in SFT data) apply to both terms. How [x ; x̂] is built: `sbd_jax.sbd.noising`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sbd_jax.sbd.cross_entropy import chunked_cross_entropy, dense_cross_entropy
from sbd_jax.sbd.masks import block_starts
from sbd_jax.sbd.noising import (
  SBDBatch,
  build_ntp_batch,
  build_sbd_batch,
  completion_anchors,
  draw_masked_positions,
)

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
  loss_chunk: int = 0  # tokens per cross-entropy chunk (sbd_jax.sbd.cross_entropy); 0 = whole
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


def sample_block_size(rng: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
  """k ~ U{k_min .. k_max}, a traced scalar (no recompilation when it changes)."""
  return jax.random.randint(rng, (), cfg.k_min, cfg.k_max + 1)


def make_batch(
  batch: dict,
  rng: jax.Array,
  cfg: ObjectiveConfig,
  *,
  block_size: int | None = None,
  mask_rate: float | None = None,
) -> tuple[SBDBatch, jax.Array]:
  """Data batch -> objective inputs and k. Fields: tokens, segment_ids, positions, loss_mask
  and (optional, zeros if absent) eos_tail, each [B, L].

  Training draws k and η (`cfg`); a held-out evaluation fixes them: `block_size` k, and
  `mask_rate` the probability with which each maskable token is masked (1: whole blocks, as
  every decoded block starts)."""
  tokens, segs, pos, loss_mask = (
    batch["tokens"],
    batch["segment_ids"],
    batch["positions"],
    batch["loss_mask"],
  )
  if cfg.mode == "ntp":
    return build_ntp_batch(tokens, segs, pos, loss_mask), jnp.zeros((), jnp.int32)
  k_rng, mask_rng = jax.random.split(rng)
  if block_size is None:
    block_size = sample_block_size(k_rng, cfg)
  else:
    block_size = jnp.asarray(block_size, jnp.int32)
  if cfg.block_anchor == "completion":
    anchors = completion_anchors(pos, segs, loss_mask)
  elif cfg.block_anchor == "row":
    anchors = pos - jnp.arange(pos.shape[1], dtype=pos.dtype)  # block starts at row i - i mod k
  else:
    anchors = 0
  if mask_rate is None:
    masked = draw_masked_positions(
      mask_rng,
      segs,
      pos,
      block_starts(pos, block_size, anchors),
      eta_beta=cfg.eta_beta,
      full_block_prob=cfg.full_block_prob,
    )
  else:
    masked = jax.random.uniform(mask_rng, tokens.shape) < mask_rate
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
    min_block_size=cfg.k_min,
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


def token_cross_entropy(model, sbd: SBDBatch, cfg: ObjectiveConfig) -> jax.Array:
  """[B, T] cross-entropy of every model position against its label (`labels`), from one
  forward over `sbd.inputs`; with cfg.loss_chunk the [T, V] logits are never whole."""
  features_BTD, _ = model.features(sbd.inputs, sbd.meta)
  targets_BT = labels(sbd, cfg.mode)
  if cfg.loss_chunk:
    return chunked_cross_entropy(model.logits, features_BTD, targets_BT, cfg.loss_chunk)
  return dense_cross_entropy(model.logits(features_BTD), targets_BT)


def loss_fn(model, batch: dict, rng: jax.Array, cfg: ObjectiveConfig):
  """Build the objective's inputs, run the model once over them, return (loss, metrics)."""
  sbd, block_size = make_batch(batch, rng, cfg)
  ce_BT = token_cross_entropy(model, sbd, cfg)
  loss, metrics = loss_from_token_ce(ce_BT, sbd, cfg.mode, cfg.matp_weight)
  return loss, {**metrics, "block_size": block_size.astype(jnp.float32)}
