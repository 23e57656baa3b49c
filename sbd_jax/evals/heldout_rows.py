"""Held-out records as the training pipeline packs them, and their plain NTP loss.

* `pack_documents`: records -> packed rows [R, L] (the pipeline's encoding and first-fit packing).
* `heldout_ntp_loss`: the NTP loss of such rows (a causal forward, no SBD layout).

Dimension letters (docs/dimensions.md): B batch, L row length, V vocabulary.
"""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.data import pipeline
from sbd_jax.sbd import noising

ROW_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")


def pack_documents(
  records: Sequence[dict[str, str]],
  tokenizer,
  seq_len: int,
  eos_tail: int = 0,
  max_rows: int | None = None,
) -> dict[str, np.ndarray]:
  """Held-out records -> packed rows [R, L] (at most `max_rows`) with the training pipeline's
  encoding and packing: documents longer than seq_len are cut into chunks, positions restart
  per chunk, a deterministic first-fit packing."""
  docs = grain.MapDataset.source(list(records)).map(
    functools.partial(_encode, tokenizer=tokenizer, eos_tail=eos_tail)
  )
  rows = pipeline.pack_rows(
    docs.to_iter_dataset(),
    seq_len=seq_len,
    packing="first_fit",
    num_bins=8,
    seed=0,
    pad_id=tokenizer.pad_id,
  )
  packed = list(itertools.islice(rows, max_rows))
  return {k: np.stack([r[k] for r in packed]) for k in packed[0]}


def _encode(record, *, tokenizer, eos_tail):
  return pipeline.encode_record(record, tokenizer, prompt_loss=False, eos_tail=eos_tail)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _ntp_loss_sums(graphdef, state, tokens_BL, segment_ids_BL, positions_BL, loss_mask_BL):
  logits_BLV, _ = nnx.merge(graphdef, state)(
    tokens_BL, TokenMeta.causal(segment_ids_BL, positions_BL)
  )
  targets_BL, weights_BL = noising.ntp_targets(tokens_BL, segment_ids_BL, loss_mask_BL)
  ce_BL = optax.softmax_cross_entropy_with_integer_labels(
    logits_BLV.astype(jnp.float32), targets_BL
  )
  return jnp.sum(ce_BL * weights_BL), jnp.sum(weights_BL)


def heldout_ntp_loss(model, rows: dict[str, np.ndarray], batch_size: int = 16) -> dict[str, float]:
  """Mean NTP cross-entropy (nats per target token) of a SamplingModel over packed rows."""
  total, count = 0.0, 0.0
  n = len(rows["tokens"])
  for first in range(0, n, batch_size):
    batch = {k: v[first : first + batch_size] for k, v in rows.items()}
    short = batch_size - len(batch["tokens"])
    if short:  # pad to a fixed shape with empty rows (segment 0: no targets)
      batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
    s, c = _ntp_loss_sums(model.graphdef, model.state, *(batch[k] for k in ROW_FIELDS))
    total, count = total + float(s), count + float(c)
  return {"loss": total / max(count, 1.0), "targets": count, "rows": n}
