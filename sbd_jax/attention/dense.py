"""Reference attention with an explicit [T, S] mask (`meta.visibility`): what the kernels are
tested against. On the SBD training layout it skips the regions that are never visible.

Dimension letters (docs/dimensions.md): B batch, T queries, S keys, N query heads, K KV heads,
G = N // K query heads per KV head, H head dim, W a block query's window of block keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.attention.meta import TokenMeta, visibility, visible_broadcast


def group_query_heads(q_BTNH: jax.Array, num_kv_heads: int) -> jax.Array:
  b, t, n, h = q_BTNH.shape
  return q_BTNH.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def _masked_softmax(s, mask):
  """Softmax over the last axis of fp32 scores where `mask`; rows with no visible key give 0."""
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def dense_attention(q_BTNH, k_BSKH, v_BSKH, q_meta: TokenMeta, kv_meta: TokenMeta):
  """Reference attention with an explicit [T, S] mask. Rows with no visible key give 0.

  On the SBD training layout (`q_meta.max_block > 0`, queries = keys) it computes only the
  regions that can be visible: clean x clean, block x clean and a band of block x block.
  """
  if q_meta.max_block and kv_meta.max_block and q_BTNH.shape[1] == k_BSKH.shape[1]:
    return _sbd_halves_attention(q_BTNH, k_BSKH, v_BSKH, q_meta)
  q_BTKGH = group_query_heads(q_BTNH, k_BSKH.shape[2]).astype(jnp.float32)
  scale = q_BTNH.shape[-1] ** -0.5
  s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH * scale, k_BSKH.astype(jnp.float32))
  p = _masked_softmax(s_BKGTS, visibility(q_meta, kv_meta)[:, None, None])
  o_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", p, v_BSKH.astype(jnp.float32))
  return o_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype)


def _sbd_halves_attention(q_BTNH, k_BTKH, v_BTKH, meta: TokenMeta):
  """`dense_attention` over [clean half ; block half] (T = 2L) without the never-visible parts.

  Clean queries attend to clean keys only. A block query attends to the clean keys and to the
  W = 2 max_block - 1 block slots centred on it (its whole block lies inside that window), in
  one softmax: 2 L^2 + L W scores instead of 4 L^2.
  """
  t, num_kv_heads = q_BTNH.shape[1], k_BTKH.shape[2]
  half, band = t // 2, meta.max_block
  plain = meta.replace(max_block=0)
  clean, block = (jax.tree.map(lambda x: x[:, s], plain) for s in (slice(0, half), slice(half, t)))
  out_clean = dense_attention(q_BTNH[:, :half], k_BTKH[:, :half], v_BTKH[:, :half], clean, clean)

  # Block queries: keys = clean half (L) ++ a window of block slots (W).
  offsets_W = jnp.arange(-(band - 1), band)
  slots_LW = jnp.arange(half)[:, None] + offsets_W[None, :]
  in_row_LW = (slots_LW >= 0) & (slots_LW < half)
  slots_LW = jnp.clip(slots_LW, 0, half - 1)
  k_b, v_b = k_BTKH[:, half:], v_BTKH[:, half:]
  k_BLWKH, v_BLWKH = k_b[:, slots_LW], v_b[:, slots_LW]
  window = jax.tree.map(lambda x: x[:, slots_LW], block)  # [B, L, W]
  expand = lambda m: jax.tree.map(lambda x: x[:, :, None], m)  # noqa: E731
  mask_window_BLW = visible_broadcast(expand(block), window) & in_row_LW
  mask_clean_BLL = visibility(block, clean)

  q_BLKGH = group_query_heads(q_BTNH[:, half:], num_kv_heads).astype(jnp.float32)
  q_BLKGH = q_BLKGH * q_BTNH.shape[-1] ** -0.5
  s_clean = jnp.einsum("BTKGH,BSKH->BKGTS", q_BLKGH, k_BTKH[:, :half].astype(jnp.float32))
  s_window = jnp.einsum("BTKGH,BTWKH->BKGTW", q_BLKGH, k_BLWKH.astype(jnp.float32))
  mask = jnp.concatenate([mask_clean_BLL, mask_window_BLW], axis=-1)[:, None, None]
  p = _masked_softmax(jnp.concatenate([s_clean, s_window], axis=-1), mask)
  o_BLKGH = jnp.einsum(
    "BKGTS,BSKH->BTKGH", p[..., :half], v_BTKH[:, :half].astype(jnp.float32)
  ) + jnp.einsum("BKGTW,BTWKH->BTKGH", p[..., half:], v_BLWKH.astype(jnp.float32))
  out_block = o_BLKGH.reshape(q_BTNH[:, half:].shape).astype(q_BTNH.dtype)
  return jnp.concatenate([out_clean, out_block], axis=1)
