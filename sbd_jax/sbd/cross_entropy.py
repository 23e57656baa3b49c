"""Per-token cross-entropy from hidden states, with the [tokens x vocab] logits whole or in chunks.

At 2 x 32k tokens and a 128k vocabulary the float32 logits of one row are 32 GiB, and the dense
loss keeps them (and their gradient) alive through the backward pass. `chunked_cross_entropy`
maps the tokens in chunks of `chunk` under `jax.checkpoint`: the forward keeps only each
chunk's per-token losses, the backward recomputes one chunk's logits at a time, so at most
[B, chunk, V] logits exist at once. Losses and gradients equal the dense ones (tested).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax


def dense_cross_entropy(logits_BTV: jax.Array, labels_BT: jax.Array) -> jax.Array:
  """[B, T] cross-entropy in float32 (whatever the logits' dtype)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), labels_BT)


def chunked_cross_entropy(
  logits_fn: Callable[[jax.Array], jax.Array],
  features_BTD: jax.Array,
  labels_BT: jax.Array,
  chunk: int,
) -> jax.Array:
  """[B, T] cross-entropy of `logits_fn(features)` computed `chunk` tokens at a time.

  `logits_fn` maps [B, C, D] features to [B, C, V] logits (the model's output layer); T need
  not be a multiple of `chunk` (the last chunk is padded, and the padding dropped).
  """
  batch, length, dim = features_BTD.shape
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length
  features_BTD = jnp.pad(features_BTD, ((0, 0), (0, pad), (0, 0)))
  labels_BT = jnp.pad(labels_BT, ((0, 0), (0, pad)))
  features_NBCD = features_BTD.reshape(batch, num_chunks, chunk, dim).swapaxes(0, 1)
  labels_NBC = labels_BT.reshape(batch, num_chunks, chunk).swapaxes(0, 1)

  @jax.checkpoint  # keep [B, C] losses, not [B, C, V] logits, for the backward pass
  def one_chunk(features_BCD, labels_BC):
    return dense_cross_entropy(logits_fn(features_BCD), labels_BC)

  ce_NBC = jax.lax.map(lambda xs: one_chunk(*xs), (features_NBCD, labels_NBC))
  return ce_NBC.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]
