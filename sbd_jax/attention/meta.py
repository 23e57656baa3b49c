"""Per-token attention metadata and the visibility rule every attention kernel follows.

Every token carries a `TokenMeta` (segment id, position, clean-vs-block flag, block start);
who may attend to whom is a pure function of the query's and the key's metadata, so training
(2L tokens, packed documents) and decoding (cache + block) share one code path and no dense
mask is ever passed around.

Dimension letters (docs/dimensions.md): B batch, T queries, S keys.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

NO_SEGMENT = 0  # segment id of padding and of empty cache slots: attends to and from nothing


@flax.struct.dataclass
class TokenMeta:
  """Per-token attention metadata, each field [B, T].

  segment_ids: document id within a packed row; 0 marks padding / empty cache slots.
  positions:   RoPE position, restarting at 0 in every document.
  is_block:    True for SBD block tokens (x̂), False for clean causal tokens.
  block_start: for block tokens, the position of the first token of the block.
  """

  segment_ids: jax.Array
  positions: jax.Array
  is_block: jax.Array
  block_start: jax.Array
  # Static layout hint (0 = none). k > 0: these are the SBD training tokens [clean half ;
  # block half] with equal positions, in blocks of at most k consecutive tokens, so a block
  # token sees only the clean half and block tokens fewer than k slots away (`dense_attention`
  # then skips the rest; `chunked_attention` hands the part within k rows of the diagonal to
  # `block_local`). The mask itself still comes from the fields above. `min_block`:
  # the smallest k these tokens may use (splash builds a kernel per k in between).
  max_block: int = flax.struct.field(pytree_node=False, default=0)
  min_block: int = flax.struct.field(pytree_node=False, default=1)

  @classmethod
  def causal(cls, segment_ids: jax.Array, positions: jax.Array) -> "TokenMeta":
    """Metadata of clean tokens only (plain next-token prediction)."""
    return cls(
      segment_ids=segment_ids.astype(jnp.int32),
      positions=positions.astype(jnp.int32),
      is_block=jnp.zeros(segment_ids.shape, bool),
      block_start=jnp.zeros(segment_ids.shape, jnp.int32),
    )

  @classmethod
  def concat(cls, metas: list["TokenMeta"]) -> "TokenMeta":
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *metas)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.segment_ids.shape


def visibility(q: TokenMeta, kv: TokenMeta) -> jax.Array:
  """Boolean [B, T, S]: may query t attend to key s?

  Within one document (equal, non-zero segment ids):
    clean query -> clean key   causal by position          (key pos <= query pos)
    block query -> clean key   strictly before the block    (key pos < query block start)
    block query -> block key   same block, both directions  (equal block starts)
    clean query -> block key   never
  """
  expand = lambda m, axis: jax.tree.map(lambda x: jnp.expand_dims(x, axis), m)  # noqa: E731
  return visible_broadcast(expand(q, 2), expand(kv, 1))


def visible_broadcast(q: TokenMeta, kv: TokenMeta) -> jax.Array:
  """`visibility` on query and key metadata already broadcast against each other."""
  same_doc = (q.segment_ids == kv.segment_ids) & (kv.segment_ids != NO_SEGMENT)
  clean_to_clean = ~q.is_block & ~kv.is_block & (kv.positions <= q.positions)
  block_to_clean = q.is_block & ~kv.is_block & (kv.positions < q.block_start)
  block_to_block = q.is_block & kv.is_block & (kv.block_start == q.block_start)
  return same_doc & (clean_to_clean | block_to_clean | block_to_block)
