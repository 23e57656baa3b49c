"""Chunked cross-entropy: the same losses and gradients as the dense loss, without ever holding
the [tokens x vocab] logits whole."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbd_jax.model import architectures
from sbd_jax.model.transformer import Transformer
from sbd_jax.sbd.cross_entropy import chunked_cross_entropy, dense_cross_entropy
from sbd_jax.sbd.objective import ObjectiveConfig, loss_fn

MASK_ID = 259
VOCAB = 300


def batch_of(rng, batch=2, length=24):
  segment_ids = np.ones((batch, length), np.int32)
  segment_ids[0, 13:] = 2
  segment_ids[1, -5:] = 0  # padding
  positions = np.tile(np.arange(length), (batch, 1))
  positions[0, 13:] = np.arange(length - 13)
  loss_mask = (segment_ids > 0).astype(np.int32)
  loss_mask[1, :6] = 0  # a prompt
  return {
    "tokens": jnp.asarray(rng.integers(0, 256, (batch, length)), jnp.int32),
    "segment_ids": jnp.asarray(segment_ids),
    "positions": jnp.asarray(positions),
    "loss_mask": jnp.asarray(loss_mask),
  }


@pytest.mark.parametrize("chunk", [1, 5, 16, 48, 100])  # dividing 2L = 48 or not, and > 2L
def test_chunked_equals_dense_function_and_gradients(chunk):
  rng = np.random.default_rng(chunk)
  features = jnp.asarray(rng.normal(size=(2, 48, 16)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(16, VOCAB)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, VOCAB, (2, 48)), jnp.int32)
  scale = jnp.asarray(rng.uniform(size=(2, 48)), jnp.float32)  # a weighted sum, like the loss

  def dense(f, w):
    return jnp.sum(dense_cross_entropy(f @ w, labels) * scale)

  def chunked(f, w):
    return jnp.sum(chunked_cross_entropy(lambda x: x @ w, f, labels, chunk) * scale)

  np.testing.assert_allclose(
    chunked_cross_entropy(lambda x: x @ weights, features, labels, chunk),
    dense_cross_entropy(features @ weights, labels),
    rtol=1e-6,
  )
  for g_chunked, g_dense in zip(
    jax.grad(chunked, argnums=(0, 1))(features, weights),
    jax.grad(dense, argnums=(0, 1))(features, weights),
  ):
    np.testing.assert_allclose(g_chunked, g_dense, rtol=1e-5, atol=1e-6)


def largest_logits(jaxpr, vocab: int, dim: int) -> int:
  """Elements of the largest array with a vocabulary axis anywhere in `jaxpr` (sub-jaxprs of
  scans, checkpoints and the like included), other than the [D, V] output layer and its
  gradient."""
  largest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = tuple(getattr(var.aval, "shape", ()))
      if vocab in shape and sorted(shape) != sorted((dim, vocab)):
        largest = max(largest, int(np.prod(shape)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      largest = max(largest, largest_logits(sub, vocab, dim))
  return largest


@pytest.mark.parametrize(
  "mode",
  [pytest.param(m, marks=pytest.mark.integration) for m in ("sbd", "ntp")] + ["matp_only"],
)
def test_model_loss_and_gradients_match_and_logits_are_never_whole(mode):
  cfg = architectures.tiny(
    num_layers=2,
    embed_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    vocab_size=VOCAB,
    tie_embeddings=False,
  )
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  batch = batch_of(np.random.default_rng(0))
  dense_cfg = ObjectiveConfig(mode=mode, mask_id=MASK_ID, k_min=3, k_max=5)
  chunked_cfg = dataclasses.replace(dense_cfg, loss_chunk=7)
  rng = jax.random.key(3)

  def value_and_grad(obj_cfg):
    return nnx.value_and_grad(lambda m: loss_fn(m, batch, rng, obj_cfg), has_aux=True)(model)

  (loss_d, metrics_d), grads_d = value_and_grad(dense_cfg)
  (loss_c, metrics_c), grads_c = value_and_grad(chunked_cfg)
  np.testing.assert_allclose(loss_c, loss_d, rtol=1e-6)
  for key in metrics_d:
    np.testing.assert_allclose(metrics_c[key], metrics_d[key], rtol=1e-6, err_msg=key)
  for g_c, g_d in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads_d)):
    np.testing.assert_allclose(g_c, g_d, rtol=1e-5, atol=1e-7)

  tokens = 2 * 24 * (1 if mode == "ntp" else 2)  # B x T of the objective's input
  graphdef, state = nnx.split(model)

  def grads_of(obj_cfg):
    def f(state):
      return nnx.grad(lambda m: loss_fn(m, batch, rng, obj_cfg)[0])(nnx.merge(graphdef, state))

    return jax.make_jaxpr(f)(state).jaxpr

  assert largest_logits(grads_of(dense_cfg), VOCAB, 32) >= tokens * VOCAB  # the probe works
  assert largest_logits(grads_of(chunked_cfg), VOCAB, 32) <= 2 * 7 * VOCAB  # B x chunk x V
