"""Splash attention (Pallas TPU kernels, run here in interpret mode) against the references.

The static SBD mask with row-anchored blocks must equal `attention.visibility` on the metadata
the objective builds, and the kernels must equal `dense_attention` in value and gradient: for
several block sizes k (one kernel per k behind a lax.switch), packed rows with padding, grouped
KV heads, the causal (NTP) layout, and inside a shard_map over a data x tensor mesh.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax import config as config_lib
from sbd_jax import sharding
from sbd_jax.attention import splash
from sbd_jax.attention.dense import dense_attention
from sbd_jax.attention.meta import NO_SEGMENT, TokenMeta, visibility
from sbd_jax.sbd import masks

L, TILE = 128, 128  # rows of L tokens; the SBD input is 2L = 2 tiles
N, K, H = 4, 2, 16  # query heads, KV heads, head dim


def packed_rows(batch=2):
  """Row 0: documents of 50, 61 and 17 tokens; row 1: 90 tokens then padding."""
  segments = np.zeros((batch, L), np.int32)
  positions = np.zeros((batch, L), np.int32)
  for row, lengths in zip(range(batch), [(50, 61, 17), (90,)] * batch):
    start = 0
    for doc, n in enumerate(lengths, 1):
      segments[row, start : start + n] = doc
      positions[row, start : start + n] = np.arange(n)
      start += n
  return jnp.asarray(segments), jnp.asarray(positions)


def row_anchored_meta(block_size, max_block=16, min_block=1):
  segments, positions = packed_rows()
  anchors = positions - jnp.arange(L)  # what make_batch uses for block_anchor="row"
  return masks.sbd_training_meta(
    segments, positions, block_size, anchors, max_block_size=max_block, min_block_size=min_block
  )


def qkv(seed=0, batch=2, length=2 * L):
  rng = np.random.RandomState(seed)
  shapes = [(batch, length, N, H), (batch, length, K, H), (batch, length, K, H)]
  return [jnp.asarray(rng.randn(*s), jnp.float32) for s in shapes]


def real_tokens(meta):
  return np.asarray(meta.segment_ids != NO_SEGMENT)


@pytest.mark.parametrize("block_size", [1, 3, 7, 16])
def test_static_mask_is_the_metadata_mask_on_row_anchored_blocks(block_size):
  meta = row_anchored_meta(block_size)
  expected = np.asarray(visibility(meta, meta))  # [B, 2L, 2L]
  static = splash.dense_mask(L, block_size)
  segments = np.asarray(meta.segment_ids)
  for row in range(2):
    same_doc = (segments[row][:, None] == segments[row][None, :]) & (segments[row] > 0)[None]
    np.testing.assert_array_equal(static & same_doc, expected[row])
  assert int(splash.block_size_of(meta)) == block_size


def loss_weights(meta):
  rng = np.random.RandomState(1)
  return jnp.asarray(rng.randn(*meta.segment_ids.shape, N, H) * real_tokens(meta)[..., None, None])


@pytest.mark.parametrize(
  "block_size, min_block", [pytest.param(3, 1, marks=pytest.mark.integration), (12, 10)]
)
def test_splash_equals_dense_attention_and_its_gradients(block_size, min_block):
  # max_block one above k: the lax.switch must pick k's kernel among the kernels of
  # min_block..k + 1, one per block size the run draws.
  meta = row_anchored_meta(block_size, max_block=block_size + 1, min_block=min_block)
  q, k, v = qkv()
  program = jax.make_jaxpr(functools.partial(splash.splash_attention, tile=TILE))(q, k, v, meta)
  switches = [e for e in program.jaxpr.eqns if e.primitive.name == "cond"]
  assert [len(e.params["branches"]) for e in switches] == [block_size + 2 - min_block]
  real = real_tokens(meta)[..., None, None]
  weights = loss_weights(meta)

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

  ours = lambda q, k, v: splash.splash_attention(q, k, v, meta, tile=TILE)  # noqa: E731
  ref = lambda q, k, v: dense_attention(q, k, v, meta, meta)  # noqa: E731
  np.testing.assert_allclose(ours(q, k, v) * real, ref(q, k, v) * real, atol=2e-5, rtol=0)
  grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
  expected = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)


def test_causal_splash_equals_dense_attention():
  segments, positions = packed_rows()
  meta = TokenMeta.causal(segments, positions)
  q, k, v = qkv(seed=2, length=L)
  real = real_tokens(meta)[..., None, None]
  out = splash.splash_attention(q, k, v, meta, tile=TILE)
  np.testing.assert_allclose(out * real, dense_attention(q, k, v, meta, meta) * real, atol=2e-5)


def test_splash_in_a_shard_map_over_data_and_tensor_axes():
  mesh = sharding.make_mesh((2, 1, 2), jax.devices()[:4])
  meta = row_anchored_meta(6, max_block=6)
  q, k, v = qkv(seed=3)
  real = real_tokens(meta)[..., None, None]

  @jax.jit
  def sharded(q, k, v, meta):
    with sharding.activation_sharding(mesh):
      return splash.splash_attention(q, k, v, meta, tile=TILE)

  out = sharded(q, k, v, meta)
  np.testing.assert_allclose(out * real, dense_attention(q, k, v, meta, meta) * real, atol=2e-5)


def test_splash_needs_row_anchored_blocks_and_whole_tiles():
  c = config_lib.base_config()
  c.model.attention_impl = "splash"
  c.train.seq_len = 256
  with pytest.raises(config_lib.ConfigError, match="block_anchor='row'"):
    config_lib.validate(c)
  c.sbd.block_anchor = "row"
  c.model.attention_chunk = 96
  with pytest.raises(config_lib.ConfigError, match="whole tiles"):
    config_lib.validate(c)
  for chunk in (128, 512):  # 512: L = 256 is one tile of the causal kernel, 2L one of SBD's
    c.model.attention_chunk = chunk
    config_lib.validate(c)


@pytest.mark.integration  # a whole model; the kernel itself is tested above
def test_a_scanned_model_with_splash_equals_the_dense_model():
  """The whole model (stacked layers, remat) with splash == with the dense reference."""
  from flax import nnx

  from sbd_jax.model import architectures
  from sbd_jax.model.transformer import Transformer

  meta = row_anchored_meta(3, max_block=4)
  tokens = jnp.asarray(np.random.RandomState(4).randint(0, 64, (2, 2 * L)), jnp.int32)
  real = jnp.asarray(real_tokens(meta), jnp.float32)

  def loss_and_grads(impl):
    cfg = architectures.tiny(
      num_layers=2,
      vocab_size=64,
      scan_layers=True,
      remat="full",
      attention_impl=impl,
      attention_chunk=TILE,
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))

    def loss(m):
      logp = jax.nn.log_softmax(m(tokens, meta)[0])
      return jnp.sum(logp[..., 5] * real)

    value, grads = nnx.value_and_grad(loss)(model)
    return value, nnx.to_pure_dict(grads)

  (value, grads), (ref_value, ref_grads) = loss_and_grads("splash"), loss_and_grads("dense")
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  # Gradient entries reach ~15 here; float32 reassociation (tiled vs dense softmax, remat) moves
  # near-zero entries by ~1e-6 of that scale, so the absolute tolerance follows the scale.
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(
      a, b, atol=max(1e-5, 2e-6 * float(np.abs(b).max())), rtol=1e-4
    ),
    grads,
    ref_grads,
  )


@pytest.mark.parametrize("seq_len, block_size, tile", [(64, 5, 8), (96, 16, 16), (64, 3, 32)])
def test_tiles_answered_from_their_corners_equal_the_mask_function(seq_len, block_size, tile):
  """Splash's host preprocessing reads the mask tile by tile; the shortcut for uniform tiles
  must give exactly the mask function's entries, at tiles smaller and larger than k."""
  mask = splash.SBDMask(seq_len, block_size)
  dense = splash.dense_mask(seq_len, block_size)
  for q0 in range(0, 2 * seq_len, tile):
    for kv0 in range(0, 2 * seq_len, tile):
      tile_ids = (slice(q0, q0 + tile), slice(kv0, kv0 + tile))
      np.testing.assert_array_equal(mask[tile_ids], dense[tile_ids])


def test_at_a_long_row_almost_every_tile_takes_the_shortcut():
  mask, tiles = splash.SBDMask(8192, 7), range(0, 2 * 8192, 512)
  mixed = sum(mask._uniform_tile(q, q + 512, kv, kv + 512) is None for q in tiles for kv in tiles)
  assert mixed <= 3 * len(tiles)  # the diagonals only: O(L / tile) of (2L / tile)^2 tiles
