"""Token metadata for the SBD layouts, and the dense masks they imply (for tests and plots).

The model never receives a dense mask: it receives `TokenMeta` and `attention.visibility`
derives who sees whom. These helpers build that metadata for the SBD training input
[x ; x̂] and for decoding, and render the implied masks as boolean matrices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.attention.meta import TokenMeta, visibility


def block_starts(
  positions_BL: jax.Array, block_size: jax.Array | int, anchors_BL: jax.Array | int = 0
) -> jax.Array:
  """First position of each token's block: blocks of `block_size` tile every document from
  its anchor (0 = the document start; a completion's first position aligns blocks with
  decoding, which starts the first block right after the prompt)."""
  offset = positions_BL.astype(jnp.int32) - anchors_BL
  return positions_BL - jnp.remainder(offset, block_size)


def sbd_training_meta(
  segment_ids_BL: jax.Array,
  positions_BL: jax.Array,
  block_size: jax.Array | int,
  anchors_BL: jax.Array | int = 0,
  max_block_size: int = 0,
  min_block_size: int = 1,
) -> TokenMeta:
  """Metadata of the 2L training input: clean half [x] then block half [x̂].

  Both halves share segment ids and positions; block tokens are grouped into blocks of
  `block_size` consecutive positions *within each document* (see `block_starts`).
  `block_size` may be a traced scalar: changing it does not recompile. `max_block_size`, a
  static bound on it (0 = unknown), lets attention skip what is never visible;
  `min_block_size`, a static lower bound, spares kernels for block sizes never drawn.
  """
  clean = TokenMeta.causal(segment_ids_BL, positions_BL)
  positions = positions_BL.astype(jnp.int32)
  block = TokenMeta(
    segment_ids=clean.segment_ids,
    positions=positions,
    is_block=jnp.ones(positions.shape, bool),
    block_start=block_starts(positions, block_size, anchors_BL).astype(jnp.int32),
  )
  return TokenMeta.concat([clean, block]).replace(
    max_block=max_block_size, min_block=min_block_size
  )


def sbd_training_mask(seq_len: int, block_size: int) -> np.ndarray:
  """Dense [2L, 2L] boolean SBD training mask of one document (the paper's Figure 8).

  For L = 8, k = 4 (rows: queries, columns: keys; left half clean x, right half x̂):

      clean x       block x̂
      1 . . . . . . . | . . . . . . . .
      1 1 . . . . . . | . . . . . . . .
      1 1 1 . . . . . | . . . . . . . .
      1 1 1 1 . . . . | . . . . . . . .     clean half: causal, never sees x̂
      1 1 1 1 1 . . . | . . . . . . . .
      1 1 1 1 1 1 . . | . . . . . . . .
      1 1 1 1 1 1 1 . | . . . . . . . .
      1 1 1 1 1 1 1 1 | . . . . . . . .
      ----------------+----------------
      . . . . . . . . | 1 1 1 1 . . . .     block 0: sees its own block only
      . . . . . . . . | 1 1 1 1 . . . .
      . . . . . . . . | 1 1 1 1 . . . .
      . . . . . . . . | 1 1 1 1 . . . .
      1 1 1 1 . . . . | . . . . 1 1 1 1     block 1: clean past of earlier blocks
      1 1 1 1 . . . . | . . . . 1 1 1 1     + its own block, both directions
      1 1 1 1 . . . . | . . . . 1 1 1 1
      1 1 1 1 . . . . | . . . . 1 1 1 1
  """
  segment_ids = jnp.ones((1, seq_len), jnp.int32)
  positions = jnp.arange(seq_len, dtype=jnp.int32)[None]
  meta = sbd_training_meta(segment_ids, positions, block_size)
  return np.asarray(visibility(meta, meta)[0])


def decode_meta(
  positions_BT: jax.Array,
  segment_ids_BT: jax.Array,
  block_start_B: jax.Array | None,
  num_clean: int,
) -> TokenMeta:
  """Metadata of one decoding forward: `num_clean` causal tokens, then block tokens.

  Block tokens (the last T - num_clean) all share `block_start_B` [B]: the position of the
  first token of the block being decoded (the paper's Figure 10 mask).
  """
  b, t = positions_BT.shape
  is_block = jnp.broadcast_to(jnp.arange(t) >= num_clean, (b, t))
  start = jnp.zeros((b,), jnp.int32) if block_start_B is None else block_start_B
  return TokenMeta(
    segment_ids=segment_ids_BT.astype(jnp.int32),
    positions=positions_BT.astype(jnp.int32),
    is_block=is_block,
    block_start=jnp.broadcast_to(start[:, None], (b, t)).astype(jnp.int32),
  )


def render(mask: np.ndarray, split: int | None = None) -> str:
  """ASCII picture of a boolean mask ('1' visible, '.' hidden), optionally split in halves."""
  rows = []
  for i, row in enumerate(np.asarray(mask)):
    cells = ["1" if v else "." for v in row]
    if split is not None:
      cells.insert(split, "|")
      if i == split:
        rows.append("-" * (2 * split) + "+" + "-" * (2 * (len(row) - split)))
    rows.append(" ".join(cells))
  return "\n".join(rows)
