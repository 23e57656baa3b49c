"""Invariances of the SBD objective and its NTP / MATP-only modes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.model import architectures
from sbd_jax.model.transformer import Transformer
from sbd_jax.sbd.noising import build_sbd_batch
from sbd_jax.sbd.objective import ObjectiveConfig, loss_fn, loss_from_logits, make_batch

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


def test_matp_weight_scales_only_the_matp_term():
  model = tiny_model()
  batch = packed_batch(np.random.default_rng(3))
  rng = jax.random.key(4)
  results = [
    loss_fn(model, batch, rng, ObjectiveConfig(mask_id=MASK_ID, matp_weight=w)) for w in (1.0, 3.0)
  ]
  (loss1, m1), (loss3, m3) = results
  assert float(m1["matp_loss"]) > 0  # the same draw, so the same terms
  np.testing.assert_allclose(float(m3["matp_loss"]), float(m1["matp_loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(loss1), float(m1["ntp_loss"] + m1["matp_loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(loss3), float(m3["ntp_loss"] + 3 * m3["matp_loss"]), rtol=1e-6)


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


def _draw(cfg, segment_ids, positions, block_start, seed=0):
  from sbd_jax.sbd.noising import draw_masked_positions

  rng = jax.random.key(seed)
  masked = draw_masked_positions(
    rng,
    segment_ids,
    positions,
    block_start,
    eta_beta=cfg.eta_beta,
    full_block_prob=cfg.full_block_prob,
  )
  return np.asarray(masked)


def test_masking_rate_is_drawn_per_document():
  """Two documents packed in one row get independent rates η ~ U(0, 1)."""
  rows, half = 256, 512
  segment_ids = jnp.asarray(np.repeat([[1] * half + [2] * half], rows, 0), jnp.int32)
  positions = jnp.asarray(np.tile(np.r_[np.arange(half), np.arange(half)], (rows, 1)))
  masked = _draw(ObjectiveConfig(mask_id=MASK_ID), segment_ids, positions, positions)
  rate_a, rate_b = masked[:, :half].mean(1), masked[:, half:].mean(1)
  assert rate_a.min() < 0.05 and rate_a.max() > 0.95 and abs(rate_a.mean() - 0.5) < 0.07
  assert abs(np.corrcoef(rate_a, rate_b)[0, 1]) < 0.25  # per row, the two rates would be equal


def test_beta_rates_and_whole_blocks():
  rows, length, k = 512, 64, 8
  segment_ids = jnp.ones((rows, length), jnp.int32)
  positions = jnp.tile(jnp.arange(length), (rows, 1))
  block_start = positions - positions % k
  skewed = _draw(
    ObjectiveConfig(mask_id=MASK_ID, eta_beta=(4.0, 1.0)), segment_ids, positions, block_start
  )
  assert abs(skewed.mean() - 0.8) < 0.03  # E[Beta(4, 1)] = 0.8
  whole = _draw(
    ObjectiveConfig(mask_id=MASK_ID, full_block_prob=0.5), segment_ids, positions, block_start
  )
  blocks = whole.reshape(rows, length // k, k)
  full = blocks.all(-1).mean()
  # P(block full) = 0.5 + 0.5 E[η^8] = 0.5 + 0.5 / 9; whole blocks are whole.
  assert abs(full - (0.5 + 0.5 / 9)) < 0.03, full


def test_prompt_tokens_stay_clean_and_blocks_can_start_at_the_completion():
  # One document: BOS + 5 prompt tokens (no loss), then 6 completion tokens.
  tokens = jnp.arange(100, 112)[None]
  ones = jnp.ones((1, 12), jnp.int32)
  positions = jnp.arange(12)[None]
  loss_mask = jnp.asarray([[0] * 6 + [1] * 6])
  everything = jnp.ones((1, 12), bool)
  sbd = build_sbd_batch(tokens, ones, positions, loss_mask, everything, 4, MASK_ID)
  np.testing.assert_array_equal(sbd.inputs[0, 12:], [*range(100, 106), *[MASK_ID] * 6])
  np.testing.assert_array_equal(sbd.meta.block_start[0, 12:], [0] * 4 + [4] * 4 + [8] * 4)
  from sbd_jax.sbd.noising import completion_anchors

  anchors = completion_anchors(positions, ones, loss_mask)
  anchored = build_sbd_batch(
    tokens, ones, positions, loss_mask, everything, 4, MASK_ID, anchors_BL=anchors
  )
  # The first block is exactly the completion's first 4 tokens, as when decoding.
  np.testing.assert_array_equal(
    anchored.meta.block_start[0, 12:], [-2] * 2 + [2] * 4 + [6] * 4 + [10] * 2
  )


def test_positions_past_eos_in_the_eos_block_are_trained_to_eos():
  """Document: BOS a b c EOS + 5 appended EOS (tail). With k = 4 the EOS (position 4) sits in
  block [4, 8): tail positions 5..7 are MATP targets (EOS), positions 8..9 (next block) are not,
  and no tail position is an NTP target."""
  bos, eos = 257, 258
  tokens = jnp.asarray([[bos, 1, 2, 3, eos, eos, eos, eos, eos, eos]])
  ones = jnp.ones((1, 10), jnp.int32)
  loss_mask = jnp.asarray([[0, 1, 1, 1, 1, 0, 0, 0, 0, 0]])
  tail = jnp.asarray([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
  everything = jnp.ones((1, 10), bool)
  sbd = build_sbd_batch(
    tokens, ones, jnp.arange(10)[None], loss_mask, everything, 4, MASK_ID, eos_tail_BL=tail
  )
  np.testing.assert_array_equal(sbd.matp_weights[0], [0, 1, 1, 1, 1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(sbd.matp_targets[0, 5:8], [eos] * 3)
  np.testing.assert_array_equal(sbd.ntp_weights[0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
  # Unmasked tail positions hold EOS, as decoding fills them once an EOS is revealed.
  none = jnp.zeros((1, 10), bool)
  clean = build_sbd_batch(
    tokens, ones, jnp.arange(10)[None], loss_mask, none, 4, MASK_ID, eos_tail_BL=tail
  )
  np.testing.assert_array_equal(clean.inputs[0, 10:], tokens[0])


def test_training_and_decoding_agree_on_a_fully_masked_block():
  """The MATP logits of the training forward for a fully masked block equal the logits of the
  decoding forward (prefill + block, the sampler's layout with left padding) for the same
  context and block."""
  from sbd_jax.model.kv_cache import KVCache
  from sbd_jax.sbd.masks import decode_meta
  from sbd_jax.sbd.noising import completion_anchors

  model = tiny_model(attention_impl="dense")
  rng = np.random.default_rng(7)
  n, k, pad = 11, 4, 5  # context tokens, block size, left padding of the prompt bucket
  tokens = jnp.asarray(rng.integers(0, 256, (1, 20)), jnp.int32)
  ones = jnp.ones((1, 20), jnp.int32)
  positions = jnp.arange(20)[None]
  loss_mask = (positions >= n).astype(jnp.int32)  # the "completion" starts at the block
  anchors = completion_anchors(positions, ones, loss_mask)
  sbd = build_sbd_batch(
    tokens, ones, positions, loss_mask, jnp.ones((1, 20), bool), k, MASK_ID, anchors_BL=anchors
  )
  train_logits = model(sbd.inputs, sbd.meta)[0][:, 20 + n : 20 + n + k]

  context = jnp.concatenate([jnp.full((1, pad), 256), tokens[:, :n]], axis=1)
  slots = jnp.arange(pad + n + k)[None]
  segment = (slots >= pad).astype(jnp.int32)
  meta = decode_meta(jnp.maximum(slots - pad, 0) * segment, segment, jnp.asarray([n]), pad + n)
  inputs = jnp.concatenate([context, jnp.full((1, k), MASK_ID)], axis=1)
  cache = KVCache.empty(model.cfg, 1, pad + n + k)
  decode_logits = model(inputs, meta, cache)[0][:, pad + n :]
  np.testing.assert_allclose(train_logits, decode_logits, atol=2e-5, rtol=1e-5)


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


def test_the_training_block_size_covers_k_min_to_k_max_and_nothing_else():
  """k ~ U{k_min .. k_max}: over many steps' draws every size in the range occurs, both ends
  included, and none outside it; the blocks the step builds have that size (row-anchored
  blocks of k tokens: the largest offset into a block is k - 1)."""
  batch = packed_batch(np.random.default_rng(6))
  for k_min, k_max in ((2, 16), (4, 4), (1, 3)):
    cfg = ObjectiveConfig(mask_id=MASK_ID, k_min=k_min, k_max=k_max, block_anchor="row")

    @jax.jit
    def draw(rng, cfg=cfg):
      sbd, k = make_batch(batch, rng, cfg)
      half = batch["tokens"].shape[1]
      offsets = sbd.meta.positions[:, half:] - sbd.meta.block_start[:, half:]
      return k, jnp.max(offsets) + 1

    ks, widths = jax.vmap(draw)(jax.random.split(jax.random.key(k_max), 600))
    assert set(np.asarray(ks).tolist()) == set(range(k_min, k_max + 1)), (k_min, k_max)
    np.testing.assert_array_equal(widths, ks)
