"""The decode's KV cache: per-layer keys and values plus every slot's token metadata.

The cache stores each layer's keys and values slots-first, [B, S, K, H], or heads-first,
[B, K, S, H] (`KVCache.heads_first`). The decode picks heads-first on TPU: attention reads the
cache heads-major there, and when rows write at their own offsets (a scatter) into a
slots-first cache, XLA copies every cache layer in every forward to change its layout
(`python -m sbd_jax.aot --mode=decode` counts those copies). On the CPU heads-first is the
slower layout, so the CPU stays slots-first.

Dimension letters (docs/dimensions.md): B batch, T new tokens, S cache slots, K KV heads,
H head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from sbd_jax.attention.meta import NO_SEGMENT, TokenMeta
from sbd_jax.model.architectures import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Per-layer keys/values, [B, S, K, H] (or with `heads_first` [B, K, S, H]), and the
  metadata of every slot [B, S].

  `end` is the number of committed slots: an int32 scalar shared by the batch (prompts are
  left-padded), or [B] when rows move through their blocks independently. Slots at or past
  `end` may hold block tokens of the current forward; their metadata marks them, so attention
  treats them correctly and the next write overwrites them.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  meta: TokenMeta
  end: jax.Array  # int32, scalar or [B]
  heads_first: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def empty(
    cls, cfg: ModelConfig, batch: int, length: int, dtype=None, heads_first: bool = False
  ) -> "KVCache":
    dtype = jnp.dtype(dtype or cfg.compute_dtype)
    k, h = cfg.num_kv_heads, cfg.head_dim
    shape = (batch, k, length, h) if heads_first else (batch, length, k, h)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    meta = TokenMeta(
      segment_ids=jnp.full((batch, length), NO_SEGMENT, jnp.int32),
      positions=jnp.zeros((batch, length), jnp.int32),
      is_block=jnp.zeros((batch, length), bool),
      block_start=jnp.zeros((batch, length), jnp.int32),
    )
    return cls(
      k=zeros,
      v=tuple(jnp.zeros_like(z) for z in zeros),
      meta=meta,
      end=jnp.zeros((), jnp.int32),
      heads_first=heads_first,
    )

  @property
  def length(self) -> int:
    return self.meta.segment_ids.shape[1]

  @property
  def logical_axes(self) -> tuple[str | None, ...]:
    """Logical axis names of a key or value layer (`sharding.ACTIVATION_RULES`)."""
    if self.heads_first:
      return ("act_batch", "act_kv_heads", None, None)
    return ("act_batch", None, "act_kv_heads", None)


class LayerCache(NamedTuple):
  """What one layer's attention reads and writes: its keys and values (`KVCache` layout), the
  metadata of every slot (this forward's tokens written), and where the new tokens go."""

  k: jax.Array
  v: jax.Array
  meta: TokenMeta
  start: jax.Array  # int32, scalar or [B]
  heads_first: bool


def write_slots(buffer: jax.Array, update: jax.Array, start: jax.Array, axis: int = 1) -> jax.Array:
  """Write `update` into `buffer` at slot `start` along `axis` (the slot axis of both, after the
  batch axis): one scalar start for every row (a dynamic-update-slice), or [B] starts (a
  scatter, in place)."""
  update = update.astype(buffer.dtype)
  if jnp.ndim(start) == 0:
    return jax.lax.dynamic_update_slice_in_dim(buffer, update, start, axis=axis)

  def write_row(row, new, s):
    return jax.lax.dynamic_update_slice_in_dim(row, new, s, axis=axis - 1)

  return jax.vmap(write_row)(buffer, update, start)
