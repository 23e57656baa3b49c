"""Chunked (flash-style) attention == dense reference, forward and backward, in fp32; on the SBD
training layout with its near-diagonal part in the block-local op, merged by log-sum-exp."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.attention import block_local
from sbd_jax.attention.chunked import balanced_chunk, chunked_attention
from sbd_jax.attention.dense import dense_attention
from sbd_jax.attention.meta import TokenMeta
from sbd_jax.sbd.masks import sbd_training_meta


def random_meta(rng, batch, length, num_docs, block_size, block_fraction):
  """Packed rows: random document boundaries, positions restarting, some block tokens."""
  segment_ids = np.zeros((batch, length), np.int32)
  positions = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=num_docs - 1, replace=False))
    bounds = [0, *cuts, length - rng.integers(0, 3)]  # maybe trailing padding
    for doc, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      segment_ids[b, lo:hi] = doc + 1
      positions[b, lo:hi] = np.arange(hi - lo)
  is_block = rng.random((batch, length)) < block_fraction
  return TokenMeta(
    jnp.asarray(segment_ids),
    jnp.asarray(positions),
    jnp.asarray(is_block),
    jnp.asarray(positions - positions % block_size),
  )


CASES = [  # batch, length, heads, kv heads, head dim, chunk, docs, block size, block fraction
  (2, 37, 4, 2, 8, 8, 3, 4, 0.5),
  (1, 64, 8, 1, 16, 16, 1, 16, 0.0),
  (3, 50, 6, 3, 4, 32, 4, 2, 1.0),
  (2, 23, 2, 2, 8, 5, 2, 3, 0.3),
]


@pytest.mark.parametrize("case", CASES)
def test_chunked_matches_dense_forward_and_gradients(case):
  batch, length, n, k, h, chunk, docs, block_size, frac = case
  rng = np.random.default_rng(sum(case[:5]))
  q = jnp.asarray(rng.normal(size=(batch, length, n, h)), jnp.float32)
  kk = jnp.asarray(rng.normal(size=(batch, length, k, h)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, length, k, h)), jnp.float32)
  meta = random_meta(rng, batch, length, docs, block_size, frac)
  dense = dense_attention(q, kk, v, meta, meta)
  chunked = chunked_attention(q, kk, v, meta, meta, chunk=chunk)
  np.testing.assert_allclose(chunked, dense, atol=1e-5, rtol=1e-5)

  weights = jnp.asarray(rng.normal(size=dense.shape), jnp.float32)

  def objective(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

  dense_grads = jax.grad(objective(lambda *a: dense_attention(*a, meta, meta)), (0, 1, 2))(q, kk, v)
  chunked_grads = jax.grad(
    objective(lambda *a: chunked_attention(*a, meta, meta, chunk=chunk)), (0, 1, 2)
  )(q, kk, v)
  for name, d, c in zip("qkv", dense_grads, chunked_grads):
    np.testing.assert_allclose(c, d, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.integration  # every layout at several lengths
def test_sbd_layout_and_different_query_and_key_lengths():
  rng = np.random.default_rng(0)
  seq_len, block_size = 24, 5
  segs = jnp.asarray(np.repeat([[1] * 10 + [2] * 14], 2, axis=0))
  pos = jnp.asarray(np.repeat([list(range(10)) + list(range(14))], 2, axis=0))
  meta = sbd_training_meta(segs, pos, block_size)
  q = jnp.asarray(rng.normal(size=(2, 2 * seq_len, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 2 * seq_len, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 2 * seq_len, 2, 8)), jnp.float32)
  for chunk in (7, 16, 64):
    np.testing.assert_allclose(
      chunked_attention(q, k, v, meta, meta, chunk=chunk),
      dense_attention(q, k, v, meta, meta),
      atol=1e-5,
    )
  # Gradients on this layout, with the static `max_block` hint that training's metadata
  # carries, keys not a whole number of chunks.
  hinted = sbd_training_meta(segs, pos, block_size, max_block_size=block_size)
  loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, hinted, hinted)))  # noqa: E731
  chunked_grads = jax.grad(loss(functools.partial(chunked_attention, chunk=7)), (0, 1, 2))(q, k, v)
  dense_grads = jax.grad(loss(dense_attention), (0, 1, 2))(q, k, v)
  for c, d in zip(chunked_grads, dense_grads):
    np.testing.assert_allclose(c, d, atol=1e-5)
  # A few queries against many keys (a decode forward against a cache).
  q_meta = jax.tree.map(lambda x: x[:, -3:], meta)
  np.testing.assert_allclose(
    chunked_attention(q[:, -3:], k, v, q_meta, meta, chunk=8),
    dense_attention(q[:, -3:], k, v, q_meta, meta),
    atol=1e-5,
  )


@pytest.mark.parametrize(
  "seq_len, chunk",
  [
    (24, 7),
    *(
      pytest.param(*p, marks=pytest.mark.integration)
      for p in [(23, 16), (17, 64), (23, 5), (30, 4)]
    ),
  ],
)
def test_sbd_halves_in_their_own_chunks_match_dense(seq_len, chunk):
  """On the hinted training layout each half is cut into balanced chunks of its own, padded
  where the half is not a whole number of them: forward and gradients still equal the dense
  reference (packed documents, trailing padding, anchored blocks)."""
  rng = np.random.default_rng(seq_len * chunk)
  first = seq_len // 3
  segs = np.repeat([[1] * first + [2] * (seq_len - first - 2) + [0] * 2], 2, axis=0)
  pos = np.repeat([list(range(first)) + list(range(seq_len - first - 2)) + [0, 0]], 2, axis=0)
  anchors = jnp.asarray(np.where(segs == 1, 2, 5))
  meta = sbd_training_meta(jnp.asarray(segs), jnp.asarray(pos), 3, anchors, max_block_size=4)
  shape = (2, 2 * seq_len)
  q = jnp.asarray(rng.normal(size=(*shape, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(*shape, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(*shape, 2, 8)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  full = meta.replace(max_block=0)  # the dense reference on the whole [2L, 2L] mask

  def loss(fn, m):
    return lambda q, k, v: jnp.sum(fn(q, k, v, m, m) * weights)

  chunked = functools.partial(chunked_attention, chunk=chunk)
  np.testing.assert_allclose(
    chunked(q, k, v, meta, meta), dense_attention(q, k, v, full, full), atol=1e-5
  )
  got = jax.grad(loss(chunked, meta), (0, 1, 2))(q, k, v)
  want = jax.grad(loss(dense_attention, full), (0, 1, 2))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("n", [1, 7, 88, 176, 177, 512, 1000])
@pytest.mark.parametrize("chunk", [1, 64, 128, 512])
def test_balanced_chunk_covers_in_fewest_chunks(n, chunk):
  c = balanced_chunk(n, chunk)
  fewest = -(-n // chunk)
  assert c <= chunk and -(-n // c) == fewest
  assert fewest * (c - 1) < n  # any shorter chunk would need another one


@pytest.mark.parametrize(
  "block_size, max_block, anchored", [(5, 5, False), (3, 8, True), (1, 2, False)]
)
def test_sbd_layout_fast_path_equals_the_full_mask(block_size, max_block, anchored):
  """On [clean ; block] rows, the dense path that skips never-visible regions (block queries
  see the clean half and a band of block slots) equals the full-mask computation, forward and
  gradients, with packed documents, padding and blocks anchored anywhere."""
  rng = np.random.default_rng(block_size)
  segs = np.repeat([[1] * 9 + [2] * 12 + [0] * 3], 2, axis=0)
  pos = np.repeat([list(range(9)) + list(range(12)) + [0] * 3], 2, axis=0)
  anchors = jnp.asarray(np.where(segs == 1, 4, 7)) if anchored else 0
  fast = sbd_training_meta(jnp.asarray(segs), jnp.asarray(pos), block_size, anchors, max_block)
  full = fast.replace(max_block=0)
  shape = (2, 48)
  q = jnp.asarray(rng.normal(size=(*shape, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(*shape, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(*shape, 2, 8)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def loss(meta):
    return lambda q, k, v: jnp.sum(dense_attention(q, k, v, meta, meta) * weights)

  np.testing.assert_allclose(
    dense_attention(q, k, v, fast, fast), dense_attention(q, k, v, full, full), atol=1e-5
  )
  for got, want in zip(
    jax.grad(loss(fast), (0, 1, 2))(q, k, v), jax.grad(loss(full), (0, 1, 2))(q, k, v)
  ):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_rows_with_nothing_visible_are_zero_not_nan():
  meta = TokenMeta.causal(jnp.array([[1, 1, 0, 0]]), jnp.array([[0, 1, 0, 0]]))
  q = jnp.ones((1, 4, 2, 4))
  kv = jnp.ones((1, 4, 2, 4))
  for out in (
    dense_attention(q, kv, kv, meta, meta),
    chunked_attention(q, kv, kv, meta, meta, chunk=2),
  ):
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, 2:], 0.0)
  grads = jax.grad(lambda q: chunked_attention(q, kv, kv, meta, meta, chunk=2).sum())(q)
  assert np.all(np.isfinite(grads))


def test_bfloat16_inputs_stay_close_to_fp32_reference():
  rng = np.random.default_rng(1)
  meta = random_meta(rng, 1, 40, 2, 4, 0.5)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 40, 4, 8)), jnp.float32) for _ in range(3))
  k, v = k[:, :, :2], v[:, :, :2]
  reference = dense_attention(q, k, v, meta, meta)
  low = chunked_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), meta, meta, chunk=16)
  assert low.dtype == jnp.bfloat16
  np.testing.assert_allclose(low.astype(jnp.float32), reference, atol=5e-2)


def test_merging_by_log_sum_exp_equals_one_softmax_over_both_key_sets():
  rng = np.random.RandomState(7)
  s, v = rng.randn(5, 9), rng.randn(9, 3)
  lse = lambda x: np.log(np.exp(x).sum(-1))  # noqa: E731
  soft = lambda x: np.exp(x - lse(x)[:, None])  # noqa: E731
  a, b = slice(0, 4), slice(4, 9)
  merged, merged_lse = block_local.merge(
    soft(s[:, a]) @ v[a], lse(s[:, a]), soft(s[:, b]) @ v[b], lse(s[:, b])
  )
  np.testing.assert_allclose(merged, soft(s) @ v, rtol=1e-5)
  np.testing.assert_allclose(merged_lse, lse(s), rtol=1e-6)
  # A set with no visible key (lse HIDDEN, near -2.4e38) drops out.
  hidden = block_local.merge(soft(s) @ v, lse(s), v[:5], np.full(5, -2.38e38, np.float32))[0]
  np.testing.assert_allclose(hidden, soft(s) @ v, rtol=1e-5)
