"""The block queries' attention near the diagonal, as a small dense op with its log-sum-exp.

On the SBD training row [clean ; block] a block query i (row i of the block half, blocks of
k <= m = `lag`) sees, within its document, the clean keys before its block and the keys of its
own block. The chunked flash kernel computes the clean keys at least m positions back (a mask
whose chunk pairs are a causal one's, for every k and any block anchoring); this op computes the
rest:

  clean keys  fewer than m positions back, before the block    (fewer than m)
  block keys  the query's own block                           (at most k)

(the kernel's part and this one split the clean keys by position, so together they are exact;
the window below holds them all where positions advance at least one per row within a
document, as in packed rows).

Queries go in chunks of C; chunk c reads the keys of rows [cC - m, (c + 1)C + m) of each half
and masks them by the metadata (`attention.visible_broadcast`). That is 2 (C + 2m) scores per
query, where a kernel over the whole row computes whole chunk pairs along the block half's
diagonal. The result merges with the kernel's by log-sum-exp (`merge`).

Dimension letters (docs/dimensions.md): B batch, L a half of the row, T = 2L, K KV heads,
G query heads per KV head, H head dim, C query chunk, W the keys a chunk reads from one half.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.attention.meta import TokenMeta, visible_broadcast

# Score of a hidden key (splash's mask value): a query with no visible key here gets an lse
# near -2.4e38 and weight 0 in the merge.
HIDDEN = -0.7 * float(jnp.finfo(jnp.float32).max)


def chunk_for(lag: int) -> int:
  """Queries per chunk: 2m (the halo on both sides is then half the keys read), at least 8."""
  return max(8, -(-2 * lag // 8) * 8)


def _windows(x: jax.Array, axis: int, chunk: int, halo: int, num: int) -> jax.Array:
  """Rows [c chunk - halo, (c + 1) chunk + halo) of `x` for c < num, zero-padded: the row axis
  becomes [num, chunk + 2 halo]. Slices and reshapes only (2 halo <= chunk)."""
  length = x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (halo, (num + 1) * chunk - length - halo)
  padded = jnp.pad(x, widths)

  def rows(start):
    part = jax.lax.slice_in_dim(padded, start, start + num * chunk, axis=axis)
    return part.reshape(*x.shape[:axis], num, chunk, *x.shape[axis + 1 :])

  tail = jax.lax.slice_in_dim(rows(chunk), 0, 2 * halo, axis=axis + 1)
  return jnp.concatenate([rows(0), tail], axis=axis + 1)


def _query_chunks(x: jax.Array, axis: int, chunk: int, num: int) -> jax.Array:
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, num * chunk - x.shape[axis])
  x = jnp.pad(x, widths)
  return x.reshape(*x.shape[:axis], num, chunk, *x.shape[axis + 1 :])


def block_local_attention(q_BKGLH, k_BKTH, v_BKTH, meta: TokenMeta, lag: int):
  """Block queries (the row's second half, scores pre-scaled) against the keys the kernel
  leaves out; `meta` covers the whole row [B, 2L]. Returns (o_BKGLH, lse_BKGL) in float32; a query
  with no visible key here gets o = 0 and lse ~ `HIDDEN`."""
  b, kh, g, length, h = q_BKGLH.shape
  chunk = chunk_for(lag)
  num = -(-length // chunk)
  split = lambda x, axis: (  # noqa: E731
    jax.lax.slice_in_dim(x, 0, length, axis=axis),
    jax.lax.slice_in_dim(x, length, 2 * length, axis=axis),
  )
  q_meta = jax.tree.map(lambda x: _query_chunks(split(x, 1)[1], 1, chunk, num), meta)
  q_BKGnCH = _query_chunks(q_BKGLH, 3, chunk, num)

  query = jax.tree.map(lambda x: x[..., None], q_meta)  # [B, n, C, 1]
  scores, values, seen_BnC = [], [], False
  for half in (0, 1):
    keys_meta = jax.tree.map(lambda x: _windows(split(x, 1)[half], 1, chunk, lag, num), meta)
    keys_meta = jax.tree.map(lambda x: x[:, :, None, :], keys_meta)  # [B, n, 1, W]
    visible_BnCW = visible_broadcast(query, keys_meta)
    if half == 0:  # the clean keys the kernel leaves out: fewer than m positions back
      visible_BnCW &= keys_meta.positions > query.positions - lag
    seen_BnC = seen_BnC | visible_BnCW.any(-1)
    k_BKnWH = _windows(split(k_BKTH, 2)[half], 2, chunk, lag, num)
    s = jnp.einsum("BKGnCH,BKnWH->BKGnCW", q_BKGnCH, k_BKnWH, preferred_element_type=jnp.float32)
    scores.append(jnp.where(visible_BnCW[:, None, None], s, HIDDEN))
    values.append(_windows(split(v_BKTH, 2)[half], 2, chunk, lag, num))
  s = jnp.concatenate(scores, axis=-1)
  lse_BKGnC = jax.nn.logsumexp(s, axis=-1)
  p = jnp.exp(s - lse_BKGnC[..., None]).astype(v_BKTH.dtype)
  width = chunk + 2 * lag
  o = sum(
    jnp.einsum(
      "BKGnCW,BKnWH->BKGnCH",
      p[..., i * width : (i + 1) * width],
      v,
      preferred_element_type=jnp.float32,
    )
    for i, v in enumerate(values)
  )
  o = jnp.where(seen_BnC[:, None, None, :, :, None], o, 0.0)  # no visible key: 0, lse HIDDEN
  o_BKGLH = o.reshape(b, kh, g, num * chunk, h)[:, :, :, :length]
  return o_BKGLH, lse_BKGnC.reshape(b, kh, g, num * chunk)[..., :length]


def merge(o1, lse1, o2, lse2):
  """Attention over the union of two disjoint key sets from each set's (output, log-sum-exp):
  o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), in float32. Outputs [..., T, H] and lse
  [..., T]; a set with no visible key must give a very negative lse (`HIDDEN`)."""
  lse = jnp.logaddexp(lse1, lse2)
  w1, w2 = jnp.exp(lse1 - lse)[..., None], jnp.exp(lse2 - lse)[..., None]
  return w1 * o1.astype(jnp.float32) + w2 * o2.astype(jnp.float32), lse
