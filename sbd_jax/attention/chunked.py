"""Chunked (flash-style) attention: an online softmax over key chunks with a custom VJP that
recomputes scores in the backward pass; memory is O(T * chunk), never O(T * S).

Chunk pairs with no visible key are skipped (about half the work of a causal mask), except each
query chunk's first key chunk, which starts its running softmax. Queries are heads-first inside
the kernel ([B, K, G, T, H]), so each chunk pair's einsums are batched matmuls over (B, K) with
no per-pair transpose of the query chunk or of its gradients. Equals `dense.dense_attention` up
to float rounding (tests/test_attention.py).

Dimension letters (docs/dimensions.md): B batch, T queries, S keys, N query heads, K KV heads,
G = N // K query heads per KV head, H head dim, C chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sbd_jax.attention import block_local
from sbd_jax.attention.dense import group_query_heads
from sbd_jax.attention.meta import NO_SEGMENT, TokenMeta, visibility


def _pad_to(x: jax.Array, multiple: int, axis: int, value=0) -> jax.Array:
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def balanced_chunk(n: int, chunk: int) -> int:
  """The smallest chunk length that covers n tokens in as few chunks of at most `chunk` as
  possible: 176 tokens at chunk 128 make two chunks of 88, not 128 and 48 padded to 128."""
  return -(-n // -(-n // chunk))


def _chunks(x: jax.Array, c: int) -> jax.Array:
  """[B, T, ...] -> [T // c, B, c, ...]."""
  b, t = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, t // c, c, *x.shape[2:]), 1, 0)


def _chunk_meta(meta: TokenMeta, c: int) -> TokenMeta:
  return jax.tree.map(lambda x: _chunks(x, c), meta)


def _heads_first_chunks(x_BTKGH: jax.Array, c: int) -> jax.Array:
  """[B, T, K, G, H] -> [T // c, B, K, G, c, H]."""
  b, t, kh, g, h = x_BTKGH.shape
  return jnp.transpose(x_BTKGH.reshape(b, t // c, c, kh, g, h), (1, 0, 3, 4, 2, 5))


def _heads_first_unchunk(x_nBKGCH: jax.Array) -> jax.Array:
  """[n, B, K, G, c, H] -> [B, n * c, K, G, H]."""
  n, b, kh, g, c, h = x_nBKGCH.shape
  return jnp.transpose(x_nBKGCH, (1, 0, 4, 2, 3, 5)).reshape(b, n * c, kh, g, h)


def _key_chunk(k, v, kv_meta: TokenMeta, j, ck: int):
  """Keys [j ck, (j + 1) ck) of unpadded [B, S, ...] inputs, read in place (no padded or
  chunk-major copy of a KV cache per forward). The last chunk's start is clamped to S - ck;
  the keys it shares with the chunk before it get NO_SEGMENT, so each key is counted once."""
  s = k.shape[1]
  start = jnp.minimum(j * ck, s - ck)
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, ck, axis=1)  # noqa: E731
  meta = jax.tree.map(take, kv_meta)
  fresh_C = start + jnp.arange(ck) >= j * ck
  meta = meta.replace(segment_ids=jnp.where(fresh_C, meta.segment_ids, NO_SEGMENT))
  return take(k), take(v), meta


def _forward(q, k, v, q_meta, kv_meta, chunks):
  """Online-softmax forward; queries padded to whole chunks, keys not. Returns (out, lse)."""
  cq, ck = chunks
  num_kv_heads = k.shape[2]
  scale = q.shape[-1] ** -0.5
  q_c = _heads_first_chunks(group_query_heads(q, num_kv_heads), cq)  # [nq, B, K, G, Cq, H]
  qm_c = _chunk_meta(q_meta, cq)
  num_key_chunks = -(-k.shape[1] // ck)

  def one_query_chunk(args):
    q_i, qm_i = args
    q_i = q_i.astype(jnp.float32) * scale

    def scores(k_j, mask_BCC):  # [B, K, G, Cq, Ck], -inf where the key is not visible
      s = jnp.einsum("BKGTH,BSKH->BKGTS", q_i, k_j.astype(jnp.float32))
      return jnp.where(mask_BCC[:, None, None], s, -jnp.inf)

    # Key chunk 0 starts the running (max, sum, output) itself rather than updating a carry
    # of -inf and zeros: XLA:CPU copies such constants into every query chunk's loop, and
    # those copies, ready at the start of each layer, make its executor hand work to a second
    # thread once per decode forward. Same values, bit for bit.
    k_0, v_0, kvm_0 = _key_chunk(k, v, kv_meta, 0, ck)
    s_0 = scores(k_0, visibility(qm_i, kvm_0))
    m_0 = s_0.max(-1)
    p_0 = jnp.exp(s_0 - jnp.where(jnp.isfinite(m_0), m_0, 0.0)[..., None])  # 0 where m_0 = -inf
    first = (m_0, p_0.sum(-1), jnp.einsum("BKGTS,BSKH->BKGTH", p_0, v_0.astype(jnp.float32)))

    def step(j, carry):
      k_j, v_j, kvm_j = _key_chunk(k, v, kv_meta, j, ck)
      m, l, acc = carry

      def update(mask_BCC):
        s = scores(k_j, mask_BCC)
        m_new = jnp.maximum(m, s.max(-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(m - shift)
        l_new = l * correction + p.sum(-1)
        acc_new = acc * correction[..., None] + jnp.einsum(
          "BKGTS,BSKH->BKGTH", p, v_j.astype(jnp.float32)
        )
        return m_new, l_new, acc_new

      mask_BCC = visibility(qm_i, kvm_j)
      return jax.lax.cond(jnp.any(mask_BCC), update, lambda _: carry, mask_BCC)

    m, l, acc = jax.lax.fori_loop(1, num_key_chunks, step, first)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, K, G, C, H]
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
    return out, lse

  out_c, lse_c = jax.lax.map(one_query_chunk, (q_c, qm_c))
  out = _heads_first_unchunk(out_c)  # [B, T, K, G, H]
  lse = jnp.moveaxis(lse_c, 0, 3)  # [B, K, G, nq, C]
  lse = lse.reshape(*lse.shape[:3], -1)  # [B, K, G, T]
  return out.reshape(q.shape).astype(q.dtype), lse


def _backward(chunks, residuals, d_out, d_lse=None):
  """FlashAttention-2 style backward: recompute scores per chunk pair. Keys are padded and
  heads-first here ([nk, B, K, Ck, H]): the backward only runs in training, on no KV cache.
  With a cotangent of the log-sum-exp, dS = P (dP - (D - dlse)): D takes it."""
  cq, ck = chunks
  q, k, v, q_meta, kv_meta_unpadded, out, lse = residuals
  no_grad = jax.tree.map(lambda _: None, (q_meta, kv_meta_unpadded))
  s = k.shape[1]  # keys come unpadded (see `_forward`)
  k, v, kv_meta = _pad_to(k, ck, 1), _pad_to(v, ck, 1), _pad_meta(kv_meta_unpadded, ck)
  b, s_padded, num_kv_heads, h = k.shape
  scale = q.shape[-1] ** -0.5
  q_g = group_query_heads(q, num_kv_heads)
  do_g = group_query_heads(d_out, num_kv_heads).astype(jnp.float32)
  delta = jnp.einsum(
    "BTKGH,BTKGH->BKGT", do_g, group_query_heads(out, num_kv_heads).astype(jnp.float32)
  )
  if d_lse is not None:
    delta = delta - d_lse.astype(jnp.float32)
  q_c, do_c = _heads_first_chunks(q_g, cq), _heads_first_chunks(do_g, cq)  # [nq, B, K, G, Cq, H]
  lse_c = jnp.moveaxis(lse.reshape(*lse.shape[:3], -1, cq), 3, 0)  # [nq, B, K, G, Cq]
  delta_c = jnp.moveaxis(delta.reshape(*delta.shape[:3], -1, cq), 3, 0)
  qm_c = _chunk_meta(q_meta, cq)
  heads_first = lambda x: jnp.swapaxes(_chunks(x, ck), 2, 3)  # noqa: E731  [nk, B, K, Ck, H]
  k_c, v_c, kvm_c = heads_first(k), heads_first(v), _chunk_meta(kv_meta, ck)

  def one_key_chunk(dq_acc, xs):
    k_j, v_j, kvm_j = xs
    k32, v32 = k_j.astype(jnp.float32), v_j.astype(jnp.float32)

    def step(carry, ys):
      dk_j, dv_j = carry
      q_i, do_i, lse_i, delta_i, qm_i = ys
      q32 = q_i.astype(jnp.float32)

      def grads(mask_BCC):
        s = jnp.einsum("BKGTH,BKSH->BKGTS", q32 * scale, k32)
        s = jnp.where(mask_BCC[:, None, None], s, -jnp.inf)
        p = jnp.exp(s - lse_i[..., None])  # [B, K, G, Cq, Ck]
        dv = jnp.einsum("BKGTS,BKGTH->BKSH", p, do_i)
        dp = jnp.einsum("BKGTH,BKSH->BKGTS", do_i, v32)
        ds = p * (dp - delta_i[..., None]) * scale
        dq = jnp.einsum("BKGTS,BKSH->BKGTH", ds, k32)
        dk = jnp.einsum("BKGTS,BKGTH->BKSH", ds, q32)
        return dk, dv, dq

      zeros = (jnp.zeros_like(dk_j), jnp.zeros_like(dv_j), jnp.zeros(q_i.shape, jnp.float32))
      mask_BCC = visibility(qm_i, kvm_j)
      dk, dv, dq = jax.lax.cond(jnp.any(mask_BCC), grads, lambda _: zeros, mask_BCC)
      return (dk_j + dk, dv_j + dv), dq

    init = (jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32))
    (dk_j, dv_j), dq_c = jax.lax.scan(step, init, (q_c, do_c, lse_c, delta_c, qm_c))
    return dq_acc + dq_c, (dk_j, dv_j)

  dq_c, (dk_c, dv_c) = jax.lax.scan(
    one_key_chunk, jnp.zeros(q_c.shape, jnp.float32), (k_c, v_c, kvm_c)
  )
  dq = _heads_first_unchunk(dq_c).reshape(q.shape).astype(q.dtype)
  keys_last = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, num_kv_heads, s_padded, h)  # noqa: E731
  dk, dv = (jnp.swapaxes(keys_last(x), 1, 2)[:, :s] for x in (dk_c, dv_c))  # [B, S, K, H]
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), *no_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_meta, kv_meta, chunks):
  return _forward(q, k, v, q_meta, kv_meta, chunks)[0]


def _flash_fwd(q, k, v, q_meta, kv_meta, chunks):
  out, lse = _forward(q, k, v, q_meta, kv_meta, chunks)
  return out, (q, k, v, q_meta, kv_meta, out, lse)


_flash.defvjp(_flash_fwd, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_lse(q, k, v, q_meta, kv_meta, chunks):
  """`_flash` and each query's log-sum-exp [B, K, G, T], differentiable in both (a query with
  no visible key: `block_local.HIDDEN`, which a merge by log-sum-exp weighs 0)."""
  return _flash_lse_fwd(q, k, v, q_meta, kv_meta, chunks)[0]


def _flash_lse_fwd(q, k, v, q_meta, kv_meta, chunks):
  out, lse = _forward(q, k, v, q_meta, kv_meta, chunks)  # lse = inf where no key is visible
  merged_lse = jnp.where(jnp.isfinite(lse), lse, block_local.HIDDEN)
  return (out, merged_lse), (q, k, v, q_meta, kv_meta, out, lse)


_flash_lse.defvjp(_flash_lse_fwd, lambda chunks, res, cts: _backward(chunks, res, *cts))


def _pad_meta(m: TokenMeta, c: int) -> TokenMeta:
  """Metadata padded along T to a multiple of `c`; pad tokens are in no segment."""
  return TokenMeta(
    segment_ids=_pad_to(m.segment_ids, c, 1, NO_SEGMENT),
    positions=_pad_to(m.positions, c, 1),
    is_block=_pad_to(m.is_block, c, 1, False),
    block_start=_pad_to(m.block_start, c, 1),
  )


def _flash_padded(q, k, v, q_meta: TokenMeta, kv_meta: TokenMeta, chunks):
  """`_flash` with queries padded to whole chunks, the padding cut from the output."""
  t, cq = q.shape[1], chunks[0]
  return _flash(_pad_to(q, cq, 1), k, v, _pad_meta(q_meta, cq), kv_meta, chunks)[:, :t]


def _sbd_halves_chunked(q_BTNH, k_BTKH, v_BTKH, meta: TokenMeta, chunk):
  """Self-attention over [clean half ; block half] (T = 2L) with blocks of at most m =
  `meta.max_block`, as three parts whose key chunks tile like causal ones:

    clean queries -> clean keys                           the flash kernel, causal
    block queries -> clean keys >= m positions back       the flash kernel, causal shifted by m
    block queries -> nearer clean keys and own block      `block_local`, a small dense op

  the block queries' two parts merged by log-sum-exp. So the kernel computes twice an NTP
  row's chunk pairs, where one pass over the 2L row computes the diagonal block-half chunks
  whole and those that blocks straddling a chunk edge make visible. Each half is cut into
  balanced chunks (padded with tokens of no segment if need be). `block_local` reads the keys
  within m rows of each query: positions must advance at least one per row within a document,
  as in packed rows."""
  b, t, n, h = q_BTNH.shape
  half, lag, kv_heads = t // 2, meta.max_block, k_BTKH.shape[2]
  c = balanced_chunk(half, chunk)
  plain = meta.replace(max_block=0)
  clean, block = (jax.tree.map(lambda x: x[:, s], plain) for s in (slice(0, half), slice(half, t)))
  q_c, k_c, v_c = q_BTNH[:, :half], k_BTKH[:, :half], v_BTKH[:, :half]
  out_clean = _flash_padded(q_c, k_c, v_c, clean, clean, (c, c))

  # The block queries' far part: as if each query's block began m - 1 positions before it.
  far = block.replace(block_start=block.positions - (lag - 1))
  q_b = _pad_to(q_BTNH[:, half:], c, 1)
  far_out_BTNH, far_lse_BKGT = _flash_lse(q_b, k_c, v_c, _pad_meta(far, c), clean, (c, c))
  far_BKGLH = jnp.moveaxis(group_query_heads(far_out_BTNH[:, :half], kv_heads), 1, 3)
  q_BKGLH = jnp.moveaxis(group_query_heads(q_BTNH[:, half:], kv_heads), 1, 3) * h**-0.5
  near_BKGLH, near_lse_BKGL = block_local.block_local_attention(
    q_BKGLH, jnp.moveaxis(k_BTKH, 1, 2), jnp.moveaxis(v_BTKH, 1, 2), meta, lag
  )
  out_BKGLH, _ = block_local.merge(far_BKGLH, far_lse_BKGT[..., :half], near_BKGLH, near_lse_BKGL)
  out_block = jnp.moveaxis(out_BKGLH, 3, 1).reshape(b, half, n, h).astype(q_BTNH.dtype)
  return jnp.concatenate([out_clean, out_block], axis=1)


def chunked_attention(
  q_BTNH, k_BSKH, v_BSKH, q_meta: TokenMeta, kv_meta: TokenMeta, chunk: int = 512
):
  """Memory-efficient attention; equals `dense_attention` up to float rounding.

  Self-attention (T = S: training, an uncached forward) runs in balanced chunks of at most
  `chunk` tokens; on the SBD training layout (`max_block` > 0) no chunk straddles the clean
  and block halves. Otherwise (decoding: the keys are a KV cache) the keys are read in place
  in chunks of `chunk`, and the queries are padded to whole chunks."""
  t, s = q_BTNH.shape[1], k_BSKH.shape[1]
  if t != s:
    chunks = (min(chunk, t), min(chunk, s))
    return _flash_padded(q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, chunks)
  if q_meta.max_block and kv_meta.max_block and t % 2 == 0:
    return _sbd_halves_chunked(q_BTNH, k_BSKH, v_BSKH, q_meta, chunk)
  c = balanced_chunk(t, chunk)
  return _flash_padded(q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, (c, c))
