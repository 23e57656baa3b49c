"""Held-out MATP loss per offset inside a block and per masking level (`loss_by_offset`), next
to the NTP loss of the same target tokens. A fully masked block's offset-0 prediction sees
exactly the context that the NTP prediction of the same token sees, so the two losses should
converge; later offsets of a fully masked block are harder than NTP (their left neighbours are
hidden). The forward in the decoding layout lives here too (`decoding_layout_forward`).

Dimension letters (docs/dimensions.md): B batch, L row length, V vocabulary, P block offsets.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sbd_jax.sbd import noising


def decoding_layout_forward(graphdef, state, batch, masked_BL, block_size: int, mask_id: int):
  """The training forward [x ; x̂] of held-out rows with blocks where decoding puts them (from
  each completion's first token). Returns (SBDBatch, float32 logits [B, 2L, V])."""
  tokens, segs, pos, loss_mask = (
    batch[k] for k in ("tokens", "segment_ids", "positions", "loss_mask")
  )
  anchors = noising.completion_anchors(pos, segs, loss_mask)
  sbd = noising.build_sbd_batch(
    tokens, segs, pos, loss_mask, masked_BL, block_size, mask_id,
    eos_tail_BL=batch.get("eos_tail"), anchors_BL=anchors,
  )  # fmt: skip
  logits_BTV, _ = nnx.merge(graphdef, state)(sbd.inputs, sbd.meta)
  return sbd, logits_BTV.astype(jnp.float32)


def onto_predicted_token(x_BL: jax.Array) -> jax.Array:
  """A clean-half value at position t (NTP predicting token t + 1), moved to position t + 1."""
  return jnp.pad(x_BL[:, :-1], ((0, 0), (1, 0)))


def counted_targets(sbd) -> jax.Array:
  """[B, L]: masked tokens with a target that NTP also predicts (same document, loss-bearing)."""
  return (sbd.matp_weights > 0) & (onto_predicted_token(sbd.ntp_weights) > 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "block_size", "mask_id"))
def _token_losses(graphdef, state, batch, masked_BL, *, block_size: int, mask_id: int):
  """Per target token: MATP loss of its block position, NTP loss of the clean position before
  it, its offset in the block, and whether it counts (masked, loss-bearing)."""
  sbd, logits_BTV = decoding_layout_forward(graphdef, state, batch, masked_BL, block_size, mask_id)
  tokens = batch["tokens"]
  length = tokens.shape[1]
  matp_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, length:], tokens)
  ntp_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, :length], sbd.ntp_targets)
  offset_BL = batch["positions"] - sbd.meta.block_start[:, length:]
  return matp_BL, onto_predicted_token(ntp_BL), offset_BL, counted_targets(sbd)


def loss_by_offset(
  model,
  rows: dict[str, np.ndarray],
  mask_id: int,
  *,
  block_size: int = 16,
  mask_rates: Sequence[float] = (1.0, 0.75, 0.5, 0.25),
  batch_size: int = 16,
  seed: int = 0,
) -> dict[str, Any]:
  """Mean MATP and NTP loss (nats) of the same held-out tokens, per block offset and masking
  rate (1.0 = every completion token masked, as in a decoding block's first forward)."""
  rng = np.random.default_rng(seed)
  n = len(rows["tokens"])
  out: dict[str, Any] = {"block_size": block_size, "rates": {}}
  for rate in mask_rates:
    sums = np.zeros((3, block_size))  # matp, ntp, count per offset
    for first in range(0, n, batch_size):
      batch = {k: v[first : first + batch_size] for k, v in rows.items()}
      short = batch_size - len(batch["tokens"])
      batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
      masked = rng.random(batch["tokens"].shape) < rate
      matp, ntp, offset, counted = jax.device_get(
        _token_losses(
          model.graphdef, model.state, batch, masked, block_size=block_size, mask_id=mask_id
        )
      )
      for values, row in ((matp, 0), (ntp, 1), (np.ones_like(matp), 2)):
        np.add.at(sums[row], offset[counted], values[counted])
    count = np.maximum(sums[2], 1)
    out["rates"][f"{rate:g}"] = {
      "matp": (sums[0] / count).tolist(),
      "ntp_same_tokens": (sums[1] / count).tolist(),
      "tokens": sums[2].astype(int).tolist(),
      "matp_mean": float(sums[0].sum() / count.sum()),
      "ntp_mean": float(sums[1].sum() / count.sum()),
    }
  return out
