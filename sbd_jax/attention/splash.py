"""Pallas splash attention (TPU) for the training layouts: causal, and SBD's [clean ; block].

Splash skips whole (query block, key block) tiles that a *static* mask leaves empty and reads
document boundaries from segment ids at run time. The SBD mask depends on the block size k,
drawn per step, so there is one kernel per k the run draws (k_min..k_max) and `lax.switch` picks
it; and the
blocks must tile the packed row (`sbd.block_anchor="row"`), not each document, for the mask to
be static: a document's first and last blocks are then cut at its boundaries by the segment
ids. With row-aligned blocks, in row indices i (query) and j (key), both halves of length L:

  clean i -> clean j   j <= i
  block i -> clean j   j < i - i mod k        (before the query's block)
  block i -> block j   j // k == i // k       (same block)
  clean i -> block j   never

which is what `attention.visibility` computes from the same metadata (tests compare the two,
forward and gradients, in Pallas interpret mode). The mask is a function of the indices
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
from sbd_jax.attention.meta import TokenMeta


def sbd_mask_function(seq_len: int, block_size: int):
  """(query indices, key indices) -> bool, over the [clean ; block] row of 2 * seq_len."""

  def visible(q_ids, kv_ids):
    q_block, kv_block = q_ids >= seq_len, kv_ids >= seq_len
    q_row = q_ids - seq_len * q_block
    kv_row = kv_ids - seq_len * kv_block
    clean_to_clean = ~q_block & ~kv_block & (kv_row <= q_row)
    block_to_clean = q_block & ~kv_block & (kv_row < q_row - q_row % block_size)
    block_to_block = q_block & kv_block & (kv_row // block_size == q_row // block_size)
    return clean_to_clean | block_to_clean | block_to_block

  return visible


class SBDMask(mask_lib._ComputableMask):  # the public masks are causal / local / numpy ones
  """The SBD training mask for rows of `seq_len` tokens and blocks of `block_size`."""

  def __init__(self, seq_len: int, block_size: int):
    self.seq_len, self.block_size = seq_len, block_size
    super().__init__((2 * seq_len, 2 * seq_len), sbd_mask_function(seq_len, block_size))

  def __getitem__(self, idx) -> np.ndarray:
    """One tile of the mask. Splash's preprocessing reads every (query, key) tile on the host
    (at 2L = 64k and 512-token tiles, 16k tiles per block size and pass); tiles that are
    wholly visible or wholly hidden are answered from their corners, only the tiles along
    the diagonals evaluate the mask function."""
    q_slice, kv_slice = (mask_lib._fill_slice(s, n) for s, n in zip(idx, self.shape))
    uniform = self._uniform_tile(q_slice.start, q_slice.stop, kv_slice.start, kv_slice.stop)
    if uniform is None:
      return super().__getitem__(idx)
    return np.full((q_slice.stop - q_slice.start, kv_slice.stop - kv_slice.start), uniform)

  def _uniform_tile(self, q0: int, q1: int, kv0: int, kv1: int) -> bool | None:
    """True / False when every entry of rows [q0, q1) x columns [kv0, kv1) is that value,
    None when the tile is mixed (or straddles the two halves)."""
    n, k = self.seq_len, self.block_size
    if (q0 < n < q1) or (kv0 < n < kv1):
      return None
    q_block, kv_block = q0 >= n, kv0 >= n
    q0, q1 = (q0 - n, q1 - n) if q_block else (q0, q1)
    kv0, kv1 = (kv0 - n, kv1 - n) if kv_block else (kv0, kv1)
    if not q_block and kv_block:  # clean -> block: never
      return False
    if not q_block:  # clean -> clean: kv <= q
      return True if kv1 - 1 <= q0 else False if kv0 > q1 - 1 else None
    if not kv_block:  # block -> clean: kv < q - q % k, a staircase rising with q
      first, last = q0 - q0 % k, (q1 - 1) - (q1 - 1) % k
      return True if kv1 - 1 < first else False if kv0 >= last else None
    # block -> block: same block of k
    if (q1 - 1) // k < kv0 // k or (kv1 - 1) // k < q0 // k:
      return False
    same = q0 // k == (q1 - 1) // k == kv0 // k == (kv1 - 1) // k
    return True if same else None

  def __eq__(self, other: object) -> bool:
    return isinstance(other, SBDMask) and (other.seq_len, other.block_size) == (
      self.seq_len,
      self.block_size,
    )

  def __hash__(self) -> int:
    return hash((SBDMask, self.seq_len, self.block_size))


@functools.lru_cache(maxsize=64)
def _kernel(length: int, block_size: int, heads_per_kv: int, tile: int, interpret: bool):
  """A splash kernel for one KV head's group of queries; block_size 0 = causal."""
  if block_size:
    mask = SBDMask(length // 2, block_size)
  else:
    mask = mask_lib.CausalMask((length, length))
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
    return kernel_lib.make_splash_mqa(
      mask=mask_lib.MultiHeadMask([mask] * heads_per_kv),
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
    )


def block_size_of(meta: TokenMeta) -> jax.Array:
  """The step's k, read from row-anchored block metadata: block_start = position - (i mod k)
  on the block half, so the largest offset into a block is k - 1 (rows hold >= k tokens)."""
  half = meta.positions.shape[1] // 2
  offset = meta.positions[0, half:] - meta.block_start[0, half:]
  return jnp.clip(jnp.max(offset) + 1, meta.min_block, meta.max_block)


def _local_attention(q_BTNH, k_BTKH, v_BTKH, meta: TokenMeta, tile: int, interpret: bool):
  """Splash over the rows and heads held by this device."""
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BTKH.shape[2]
  group = n // kv_heads
  q_BKGTH = jnp.moveaxis(q_BTNH.reshape(b, t, kv_heads, group, h), 1, 3) * h**-0.5
  k_BKTH, v_BKTH = jnp.moveaxis(k_BTKH, 1, 2), jnp.moveaxis(v_BTKH, 1, 2)

  def run(kernel):
    def one_row(q_KGTH, k_KTH, v_KTH, segments_T):
      segments = kernel_lib.SegmentIds(q=segments_T, kv=segments_T)
      per_head = lambda q, k, v: kernel(q, k, v, segment_ids=segments)  # noqa: E731
      return jax.vmap(per_head)(q_KGTH, k_KTH, v_KTH)

    return jax.vmap(one_row)(q_BKGTH, k_BKTH, v_BKTH, meta.segment_ids)

  if meta.max_block == 0:
    out_BKGTH = run(_kernel(t, 0, group, tile, interpret))
  else:
    sizes = range(meta.min_block, meta.max_block + 1)  # the k the run draws, one kernel each
    kernels = [_kernel(t, k, group, tile, interpret) for k in sizes]
    branches = [functools.partial(lambda kern, _: run(kern), kern) for kern in kernels]
    out_BKGTH = jax.lax.switch(block_size_of(meta) - meta.min_block, branches, None)
  return jnp.moveaxis(out_BKGTH, 3, 1).reshape(b, t, n, h).astype(q_BTNH.dtype)


def splash_attention(q_BTNH, k_BTKH, v_BTKH, meta: TokenMeta, *, tile: int = 512):
  """Attention of the training layout (queries = keys, `meta` causal or SBD with row-anchored
  blocks) with splash kernels; under `sharding.activation_sharding` it runs per device in a
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


def dense_mask(seq_len: int, block_size: int) -> np.ndarray:
  """The splash mask as a [2L, 2L] array (small sizes; tests and pictures)."""
  ids = np.arange(2 * seq_len)
  return sbd_mask_function(seq_len, block_size)(ids[:, None], ids[None, :])
