"""Invariances of the SBD objective and its NTP / MATP-only modes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sbd_jax import architectures
from sbd_jax.attention import TokenMeta
from sbd_jax.model import Transformer
from sbd_jax.objective import (
  ObjectiveConfig,
  build_sbd_batch,
  loss_fn,
  loss_from_logits,
  make_batch,
)

MASK_ID = 259


def tiny_model(**overrides):
  cfg = architectures.tiny(
    num_layers=2,
    embed_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    attention_chunk=16,
    **overrides,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))


def packed_batch(rng, batch=2, length=24):
  tokens = rng.integers(0, 256, size=(batch, length))
  segment_ids = np.ones((batch, length), np.int32)
  positions = np.tile(np.arange(length), (batch, 1))
  segment_ids[0, 10:] = 2
  positions[0, 10:] = np.arange(length - 10)
  segment_ids[1, -3:] = 0  # padding
  loss_mask = (segment_ids > 0).astype(np.int32)
  loss_mask[0, :4] = 0  # a "prompt"
  return {
    "tokens": jnp.asarray(tokens, jnp.int32),
    "segment_ids": jnp.asarray(segment_ids),
    "positions": jnp.asarray(positions),
    "loss_mask": jnp.asarray(loss_mask),
  }


def test_clean_half_logits_do_not_depend_on_the_masked_half():
  model = tiny_model()
  batch = packed_batch(np.random.default_rng(0))
  args = (batch["tokens"], batch["segment_ids"], batch["positions"], batch["loss_mask"])
  length = batch["tokens"].shape[1]
  forward = nnx.jit(lambda model, inputs, meta: model(inputs, meta)[0])
  logits = []
  for seed, k in [(1, 4), (2, 7)]:
    masked = jax.random.uniform(jax.random.key(seed), batch["tokens"].shape) < 0.6
    sbd = build_sbd_batch(*args, masked, k, MASK_ID)
    logits.append(forward(model, sbd.inputs, sbd.meta))
  np.testing.assert_array_equal(logits[0][:, :length], logits[1][:, :length])
  assert not np.allclose(logits[0][:, length:], logits[1][:, length:])
  plain, _ = model(batch["tokens"], TokenMeta.causal(batch["segment_ids"], batch["positions"]))
  np.testing.assert_allclose(logits[0][:, :length], plain, atol=1e-5)


def test_matp_term_vanishes_when_nothing_is_masked():
  model = tiny_model()
  batch = packed_batch(np.random.default_rng(1))
  args = (batch["tokens"], batch["segment_ids"], batch["positions"], batch["loss_mask"])
  sbd = build_sbd_batch(*args, jnp.zeros(batch["tokens"].shape, bool), 4, MASK_ID)
  _, metrics = loss_from_logits(model(sbd.inputs, sbd.meta)[0], sbd, "sbd")
  assert float(metrics["matp_loss"]) == 0.0 and float(metrics["masked_tokens"]) == 0.0
  assert float(metrics["loss"]) == float(metrics["ntp_loss"]) > 0


def test_ntp_mode_is_the_plain_causal_lm_loss():
  model = tiny_model()
  batch = packed_batch(np.random.default_rng(2))
  loss, metrics = loss_fn(
    model, batch, jax.random.key(0), ObjectiveConfig(mode="ntp", mask_id=MASK_ID)
  )
  # Independent reference: per-document shifted cross-entropy, prompt tokens excluded.
  logits, _ = model(batch["tokens"], TokenMeta.causal(batch["segment_ids"], batch["positions"]))
  total, count = 0.0, 0
  tokens, segs, mask = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
  for b in range(tokens.shape[0]):
    for t in range(tokens.shape[1] - 1):
      if segs[b, t] and segs[b, t] == segs[b, t + 1] and mask[b, t + 1]:
        total += float(
          optax.softmax_cross_entropy_with_integer_labels(logits[b, t], tokens[b, t + 1])
        )
        count += 1
  np.testing.assert_allclose(float(loss), total / count, rtol=1e-5)
  assert float(metrics["matp_loss"]) == 0.0


def test_loss_is_shared_normalisation_of_both_terms_and_matp_only_drops_ntp():
  model = tiny_model()
  batch = packed_batch(np.random.default_rng(3))
  rng = jax.random.key(5)
  full, m_full = loss_fn(model, batch, rng, ObjectiveConfig(mask_id=MASK_ID))
  ablation, m_abl = loss_fn(model, batch, rng, ObjectiveConfig(mode="matp_only", mask_id=MASK_ID))
  np.testing.assert_allclose(
    float(full), float(m_full["ntp_loss"] + m_full["matp_loss"]), rtol=1e-6
  )
  np.testing.assert_allclose(float(ablation), float(m_abl["matp_loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m_full["matp_loss"]), float(m_abl["matp_loss"]), rtol=1e-6)
  assert float(m_full["matp_loss"]) > 0


def test_loss_mask_applies_to_both_terms():
  batch = packed_batch(np.random.default_rng(4))
  cfg = ObjectiveConfig(mask_id=MASK_ID, k_min=3, k_max=3)
  sbd, _ = make_batch(batch, jax.random.key(0), cfg)
  prompt = np.asarray(batch["loss_mask"]) == 0
  assert not np.asarray(sbd.matp_weights)[prompt].any()
  # NTP target at t is token t + 1: weight 0 when token t + 1 is a prompt/padding token.
  next_prompt = np.pad(prompt[:, 1:], ((0, 0), (0, 1)), constant_values=True)
  assert not np.asarray(sbd.ntp_weights)[next_prompt].any()


def test_masked_positions_follow_a_per_sequence_rate():
  from sbd_jax.objective import draw_masked_positions

  masked = np.asarray(draw_masked_positions(jax.random.key(0), (64, 4096)))
  rates = masked.mean(axis=1)
  assert rates.min() < 0.1 and rates.max() > 0.9  # η ~ U(0, 1) per sequence
  assert abs(rates.mean() - 0.5) < 0.1


def test_block_size_is_traced_and_changes_do_not_recompile():
  model = tiny_model()
  graphdef, state = nnx.split(model)
  batch = packed_batch(np.random.default_rng(5))

  @jax.jit
  def run(state, rng):
    loss, metrics = loss_fn(
      nnx.merge(graphdef, state), batch, rng, ObjectiveConfig(mask_id=MASK_ID, k_min=2, k_max=16)
    )
    return loss, metrics["block_size"]

  sizes = {float(run(state, jax.random.key(i))[1]) for i in range(12)}
  assert len(sizes) > 3 and all(2 <= s <= 16 for s in sizes)
  assert run._cache_size() == 1
