"""What a wholly masked block's first forward (a decoding block's first pass) gets wrong:
`masked_misses` counts tokens it predicts wrong where NTP predicts them right, and whether the
EB entropy rule commits them in that forward (`eb_entropy_first_forward`): the rule bounds the
entropies ranked before the last token it reveals, not that token's own.

Dimension letters (docs/dimensions.md): B batch, L row length, V vocabulary.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.evals.block_losses import (
  counted_targets,
  decoding_layout_forward,
  onto_predicted_token,
)
from sbd_jax.sbd import reveal_rules


def eb_entropy_first_forward(entropy_BL, open_BL, block_id_BL, gamma) -> jax.Array:
  """[B, L] bools: what `reveal_rules.eb_entropy` reveals in one forward, for blocks laid out
  anywhere in a row (`block_id_BL` equal within a block), open positions only. Stable order:
  a tie goes to the left position; a position is revealed when it ranks first in its block or
  the open entropies ranked before it sum to at most γ (γ > 0)."""
  index = jnp.arange(entropy_BL.shape[1])
  same_block_BLL = block_id_BL[:, :, None] == block_id_BL[:, None, :]
  ranked_before_BLL = (entropy_BL[:, None, :] < entropy_BL[:, :, None]) | (
    (entropy_BL[:, None, :] == entropy_BL[:, :, None]) & (index[None, :] < index[:, None])
  )
  before_BLL = same_block_BLL & ranked_before_BLL & open_BL[:, None, :]
  prior_BL = jnp.sum(jnp.where(before_BLL, entropy_BL[:, None, :], 0.0), axis=-1)
  first_rank_BL = ~before_BLL.any(-1)
  return open_BL & (first_rank_BL | ((prior_BL <= gamma) & (gamma > 0)))


@functools.partial(jax.jit, static_argnames=("graphdef", "block_size", "mask_id"))
def _whole_block_predictions(graphdef, state, batch, gamma, *, block_size: int, mask_id: int):
  """Each completion token predicted from a wholly masked block (a decoding block's first
  forward) and by NTP from the clean context. Per token [B, L]: the masked and the NTP argmax,
  the masked prediction's entropy, whether the EB entropy rule at `gamma` reveals it in that
  first forward, and whether it counts (masked, with an NTP target)."""
  tokens = batch["tokens"]
  sbd, logits_BTV = decoding_layout_forward(
    graphdef, state, batch, jnp.ones(tokens.shape, bool), block_size, mask_id
  )
  # As the sampler does: the mask token is never a candidate.
  logp_BTV = jax.nn.log_softmax(logits_BTV.at[..., mask_id].set(-jnp.inf))
  length = tokens.shape[1]
  matp_logp, ntp_logp = logp_BTV[:, length:], logp_BTV[:, :length]
  entropy_BL = reveal_rules.entropy(matp_logp)
  open_BL = sbd.inputs[:, length:] == mask_id
  # One id per (document, block): block starts repeat across the documents of a packed row.
  block_BL = sbd.meta.block_start[:, length:] * (length + 1) + batch["segment_ids"]
  first_forward_BL = eb_entropy_first_forward(entropy_BL, open_BL, block_BL, gamma)
  ntp_argmax_BL = onto_predicted_token(jnp.argmax(ntp_logp, -1))
  counted_BL = counted_targets(sbd)
  return jnp.argmax(matp_logp, -1), ntp_argmax_BL, entropy_BL, first_forward_BL, counted_BL


def masked_misses(
  model,
  rows: dict[str, np.ndarray],
  mask_id: int,
  tokenizer,
  *,
  block_size: int,
  gamma: float,
  batch_size: int = 16,
  num_listed: int = 8,
) -> dict[str, Any]:
  """Where a wholly masked block's greedy prediction misses a token that NTP gets right, and
  whether the EB entropy rule at `gamma` would commit it in the block's first forward.

  The rule bounds the entropies ranked *before* the last token it reveals, not that token's
  own: in a block whose other tokens are certain, an uncertain one comes out with them. Misses
  revealed that way (`revealed_first_forward`, most with entropy above γ) are what SBD loses
  against NTP when the masked prediction is weaker than NTP on some tokens.
  """
  totals = dict(tokens=0, ntp_right=0, matp_right=0)
  misses: list[tuple[int, int, float, bool]] = []  # (gold, predicted, entropy, first forward)
  for first in range(0, len(rows["tokens"]), batch_size):
    batch = {k: v[first : first + batch_size] for k, v in rows.items()}
    out = _whole_block_predictions(
      model.graphdef, model.state, batch, jnp.float32(gamma), block_size=block_size,
      mask_id=mask_id,
    )  # fmt: skip
    matp, ntp, ent, first_fwd, counted = jax.device_get(out)
    gold = batch["tokens"]
    totals["tokens"] += int(counted.sum())
    totals["ntp_right"] += int((counted & (ntp == gold)).sum())
    totals["matp_right"] += int((counted & (matp == gold)).sum())
    miss = counted & (ntp == gold) & (matp != gold)
    misses += [
      (gold[i], matp[i], float(ent[i]), bool(first_fwd[i])) for i in zip(*np.nonzero(miss))
    ]
  by_gold: dict[int, list] = {}
  for g, m, e, f in misses:
    by_gold.setdefault(int(g), []).append((int(m), e, f))
  listed = sorted(by_gold.items(), key=lambda kv: -len(kv[1]))[:num_listed]
  revealed = [e for _, _, e, f in misses if f]
  n = max(totals["tokens"], 1)
  return {
    "block_size": block_size,
    "gamma": gamma,
    "tokens": totals["tokens"],
    "ntp_accuracy": totals["ntp_right"] / n,
    "masked_accuracy": totals["matp_right"] / n,
    "misses": len(misses),
    "revealed_first_forward": len(revealed),
    "revealed_above_gamma": sum(e > gamma for e in revealed),
    "mean_entropy_revealed": float(np.mean(revealed)) if revealed else 0.0,
    "most_missed": [
      {
        "token": tokenizer.decode([g]),
        "count": len(v),
        "predicted": tokenizer.decode(
          [collections.Counter(m for m, _, _ in v).most_common(1)[0][0]]
        ),
        "mean_entropy": float(np.mean([e for _, e, _ in v])),
      }
      for g, v in listed
    ],
  }
