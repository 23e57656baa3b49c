"""Pallas splash attention (TPU) for the training layouts: causal, and SBD's [clean ; block].

Splash skips whole (query tile, key tile) pairs that a *static* mask leaves empty and reads
document boundaries from segment ids at run time. On the SBD row (both halves of length L, row
indices i for queries and j for keys, blocks of k <= m = `meta.max_block`) the kernel's mask is

  clean i -> clean j   j <= i
  block i -> clean j   j <= i - m      (before the query's block for every k <= m)
  block i -> block j   never
  clean i -> block j   never

which tiles exactly as two causal masks: the kernel computes twice an NTP row's tile pairs, for
every k and any block anchoring, and one kernel serves every k the run draws. The rest of what a
block query sees (the clean keys fewer than m rows back that precede its block, and its own
block) is a small dense op, `block_local`, merged with the kernel's output by log-sum-exp
(`splash_lse`). Within a document that union is `attention.visibility`; the tests compare the
two, forward and gradients, in Pallas interpret mode. The mask is a function of the indices
(`_ComputableMask`): nothing [2L, 2L]-sized is built, on the host or on the device. Decoding
(queries shorter than one tile, a KV cache) uses the other kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from sbd_jax import sharding
from sbd_jax.attention import block_local, splash_lse
from sbd_jax.attention.meta import TokenMeta


def splash_mask_function(seq_len: int, lag: int):
  """(query indices, key indices) -> bool: the kernel's part of the [clean ; block] row of
  2 * seq_len, block queries seeing the clean keys at least `lag` rows back."""

  def visible(q_ids, kv_ids):
    q_block = q_ids >= seq_len
    q_row = q_ids - seq_len * q_block
    return (kv_ids < seq_len) & (kv_ids <= q_row - lag * q_block)

  return visible


class SBDSplashMask(mask_lib._ComputableMask):  # the public masks are causal / local / numpy
  """The splash part of the SBD training mask for rows of `seq_len` tokens, blocks <= `lag`.

  For L = 6, m = 2 (rows: queries, columns: keys; left half clean, right half block):

      1 . . . . . | . . . . . .
      1 1 . . . . | . . . . . .
      1 1 1 . . . | . . . . . .     clean queries: causal
      1 1 1 1 . . | . . . . . .
      1 1 1 1 1 . | . . . . . .
      1 1 1 1 1 1 | . . . . . .
      ------------+------------
      . . . . . . | . . . . . .     block queries: the clean keys >= m rows back;
      . . . . . . | . . . . . .     the nearer clean keys before the block and the
      1 . . . . . | . . . . . .     block itself are `block_local`'s
      1 1 . . . . | . . . . . .
      1 1 1 . . . | . . . . . .
      1 1 1 1 . . | . . . . . .
  """

  def __init__(self, seq_len: int, lag: int):
    self.seq_len, self.lag = seq_len, lag
    super().__init__((2 * seq_len, 2 * seq_len), splash_mask_function(seq_len, lag))

  def __getitem__(self, idx) -> np.ndarray:
    """One tile of the mask. Splash's preprocessing reads every (query, key) tile on the host
    (at 2L = 64k and 512-token tiles, 16k tiles); tiles that are wholly visible or wholly
    hidden are answered from their corners, only the diagonal tiles evaluate the function."""
    q_slice, kv_slice = (mask_lib._fill_slice(s, n) for s, n in zip(idx, self.shape))
    uniform = self._uniform_tile(q_slice.start, q_slice.stop, kv_slice.start, kv_slice.stop)
    if uniform is None:
      return super().__getitem__(idx)
    return np.full((q_slice.stop - q_slice.start, kv_slice.stop - kv_slice.start), uniform)

  def _uniform_tile(self, q0: int, q1: int, kv0: int, kv1: int) -> bool | None:
    """True / False when every entry of rows [q0, q1) x columns [kv0, kv1) is that value,
    None when the tile is mixed (or its queries straddle the two halves)."""
    n = self.seq_len
    if kv0 >= n:  # block keys: never
      return False
    if q0 < n < q1 or kv1 > n:
      return None
    shift = n + self.lag if q0 >= n else 0  # visible: kv <= q - shift
    return True if kv1 - 1 <= q0 - shift else False if kv0 > q1 - 1 - shift else None

  def __eq__(self, other: object) -> bool:
    return isinstance(other, SBDSplashMask) and (other.seq_len, other.lag) == (
      self.seq_len,
      self.lag,
    )

  def __hash__(self) -> int:
    return hash((SBDSplashMask, self.seq_len, self.lag))


@functools.lru_cache(maxsize=64)
def _kernel(length: int, lag: int, heads_per_kv: int, tile: int, interpret: bool):
  """A splash kernel for one KV head's group of queries: causal (lag 0), or the SBD row's
  splash part (lag = the largest block), which returns its log-sum-exp with a gradient."""
  mask = SBDSplashMask(length // 2, lag) if lag else mask_lib.CausalMask((length, length))
  tile = min(tile, length)
  sizes = kernel_lib.BlockSizes(
    block_q=tile,
    block_kv=tile,
    block_kv_compute=tile,
    block_q_dkv=tile,
    block_kv_dkv=tile,
    block_kv_dkv_compute=tile,
    block_q_dq=tile,
    block_kv_dq=tile,
  )
  # The kernel's mask tables are built eagerly, even when the first call is inside a trace:
  # the cache outlives that trace, and tables made of its tracers would leak into the next.
  with jax.ensure_compile_time_eval():
    kernel = kernel_lib.make_splash_mqa(
      mask=mask_lib.MultiHeadMask([mask] * heads_per_kv),
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
      save_residuals=bool(lag),
      interpret=interpret,
    )
  return splash_lse.with_logsumexp(kernel) if lag else kernel


def _local_attention(q_BTNH, k_BTKH, v_BTKH, meta: TokenMeta, tile: int, interpret: bool):
  """Splash (and, on the SBD row, the block-local op) over the rows and heads of this device."""
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BTKH.shape[2]
  group = n // kv_heads
  q_BKGTH = jnp.moveaxis(q_BTNH.reshape(b, t, kv_heads, group, h), 1, 3) * h**-0.5
  k_BKTH, v_BKTH = jnp.moveaxis(k_BTKH, 1, 2), jnp.moveaxis(v_BTKH, 1, 2)
  lag = meta.max_block
  kernel = _kernel(t, lag, group, tile, interpret)

  def one_row(q_KGTH, k_KTH, v_KTH, segments_T):
    segments = kernel_lib.SegmentIds(q=segments_T, kv=segments_T)
    per_head = lambda q, k, v: kernel(q, k, v, segment_ids=segments)  # noqa: E731
    return jax.vmap(per_head)(q_KGTH, k_KTH, v_KTH)

  out = jax.vmap(one_row)(q_BKGTH, k_BKTH, v_BKTH, meta.segment_ids)
  if lag:
    o_BKGTH, lse_BKGT = out
    half = t // 2
    near_BKGLH, near_lse_BKGL = block_local.block_local_attention(
      q_BKGTH[:, :, :, half:], k_BKTH, v_BKTH, meta, lag
    )
    block_BKGLH, _ = block_local.merge(
      o_BKGTH[:, :, :, half:], lse_BKGT[..., half:], near_BKGLH, near_lse_BKGL
    )
    out = jnp.concatenate([o_BKGTH[:, :, :, :half], block_BKGLH.astype(o_BKGTH.dtype)], axis=3)
  return jnp.moveaxis(out, 3, 1).reshape(b, t, n, h).astype(q_BTNH.dtype)


def splash_attention(q_BTNH, k_BTKH, v_BTKH, meta: TokenMeta, *, tile: int = 512):
  """Attention of the training layout (queries = keys, `meta` causal or the SBD row with
  `max_block` set, blocks anchored anywhere) with splash kernels; under `sharding.activation_sharding` it runs per device in a
  shard_map (rows over data x fsdp, heads over tensor). Off TPU, Pallas interprets it."""
  context = sharding.current_activation_sharding()
  mesh = context[0] if context else None
  platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
  local = functools.partial(_local_attention, tile=tile, interpret=platform != "tpu")
  if mesh is None:
    return local(q_BTNH, k_BTKH, v_BTKH, meta)
  mesh, rules = context
  spec = lambda axes, x: sharding.logical_to_spec(axes, rules, mesh, x.shape)  # noqa: E731
  q_spec = spec(("act_batch", None, "act_heads", None), q_BTNH)
  kv_spec = spec(("act_batch", None, "act_kv_heads", None), k_BTKH)
  row_spec = spec(("act_batch", None), meta.segment_ids)
  meta_spec = jax.tree.map(lambda _: row_spec, meta)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec, meta_spec),
    out_specs=q_spec,
    check_vma=False,
  )(q_BTNH, k_BTKH, v_BTKH, meta)


def dense_mask(seq_len: int, lag: int) -> np.ndarray:
  """The kernel's SBD mask as a [2L, 2L] array (small sizes; tests and pictures)."""
  ids = np.arange(2 * seq_len)
  return splash_mask_function(seq_len, lag)(ids[:, None], ids[None, :])
