"""The SBD attention masks against the paper's pictures (Figures 8 and 10)."""

import jax.numpy as jnp
import numpy as np

from sbd_jax.attention.meta import TokenMeta, visibility
from sbd_jax.sbd.masks import decode_meta, render, sbd_training_mask
from sbd_jax.sbd.noising import build_sbd_batch

# Figure 8 of the paper, L = 8, k = 4: rows are queries, columns keys, [x ; x̂].
FIGURE_8 = np.array(
  [
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
  ],
  dtype=bool,
)


def test_training_mask_is_figure_8():
  np.testing.assert_array_equal(sbd_training_mask(8, 4), FIGURE_8)


def test_training_mask_matches_the_papers_index_rules():
  for seq_len, k in [(8, 1), (8, 3), (12, 5), (16, 16)]:
    mask = sbd_training_mask(seq_len, k)
    for q in range(2 * seq_len):
      for j in range(2 * seq_len):
        if q < seq_len and j < seq_len:
          expected = j <= q
        elif q >= seq_len and j >= seq_len:
          expected = (q - seq_len) // k == (j - seq_len) // k
        elif q >= seq_len:
          expected = (q - seq_len) // k > j // k
        else:
          expected = False
        assert mask[q, j] == expected, (seq_len, k, q, j)


def test_docstring_picture_is_the_rendered_mask():
  picture = render(sbd_training_mask(8, 4), split=8)
  doc = sbd_training_mask.__doc__
  for row in picture.splitlines():
    assert row.replace(" ", "") in doc.replace(" ", ""), row


def test_paper_worked_example_inputs_and_targets():
  # The paper's worked example (Figure 8): k = 4, L = 8; x̂ = x1 m x3 m | m m x7 m.
  mask_id = 99
  tokens = jnp.arange(1, 9)[None]  # x1..x8 -> ids 1..8
  masked = jnp.array([[0, 1, 0, 1, 1, 1, 0, 1]], bool)
  ones = jnp.ones((1, 8), jnp.int32)
  batch = build_sbd_batch(tokens, ones, jnp.arange(8)[None], ones, masked, 4, mask_id)
  m = mask_id
  np.testing.assert_array_equal(batch.inputs[0, 8:], [1, m, 3, m, m, m, 7, m])
  has_target = np.asarray(batch.matp_weights[0]) > 0
  np.testing.assert_array_equal(has_target, [0, 1, 0, 1, 1, 1, 0, 1])
  np.testing.assert_array_equal(np.asarray(batch.matp_targets[0])[has_target], [2, 4, 5, 6, 8])
  # NTP half: position t predicts x_{t+1}; the last token has no target inside the row.
  np.testing.assert_array_equal(batch.ntp_targets[0, :7], [2, 3, 4, 5, 6, 7, 8])
  np.testing.assert_array_equal(batch.ntp_weights[0], [1, 1, 1, 1, 1, 1, 1, 0])


def test_packed_documents_never_see_each_other_and_blocks_restart():
  segment_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
  from sbd_jax.sbd.masks import sbd_training_meta

  meta = sbd_training_meta(segment_ids, positions, 2)
  mask = np.asarray(visibility(meta, meta)[0])
  seg = np.tile(np.asarray(segment_ids[0]), 2)
  cross = seg[:, None] != seg[None, :]
  assert not mask[cross].any()
  assert not mask[seg == 0].any() and not mask[:, seg == 0].any()
  # Document 2's block x̂ at positions 2..3 (block start 2) sees clean positions 0..1 only.
  row = mask[8 + 5]
  np.testing.assert_array_equal(np.nonzero(row)[0], [3, 4, 13, 14])


def test_decode_mask_is_figure_10():
  # 3 cached clean tokens, 2 clean tokens of the previous block, a block of 3 at position 5.
  positions = jnp.arange(8)[None]
  meta = decode_meta(positions, jnp.ones((1, 8), jnp.int32), jnp.array([5]), num_clean=5)
  mask = np.asarray(visibility(meta, meta)[0]).astype(int)
  expected = np.tril(np.ones((8, 8), int))
  expected[5:, :5] = 1
  expected[5:, 5:] = 1
  np.testing.assert_array_equal(mask, expected)
  clean = TokenMeta.causal(jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None])
  np.testing.assert_array_equal(visibility(clean, clean)[0], np.tril(np.ones((4, 4), bool)))
