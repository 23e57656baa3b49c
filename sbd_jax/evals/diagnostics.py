"""Diagnostics that tell a weak model from a bug.

* `loss_by_offset`: held-out MATP loss per offset inside a block and per masking level, next to
  the NTP loss of the same target tokens. A fully masked block's offset-0 prediction sees exactly
  the context that the NTP prediction of the same token sees, so the two losses should converge;
  later offsets of a fully masked block are harder than NTP (their left neighbours are hidden).
* `heldout_ntp_loss`: the plain NTP loss of held-out rows (a causal forward, no SBD layout).
* `masked_misses`: tokens that a wholly masked block (a decoding block's first forward) gets
  wrong where NTP gets them right, and whether the EB entropy rule commits them in that forward:
  the rule bounds the entropies ranked before the last token it reveals, not that token's own.
* `reveal_groups`: which tokens of a decoded answer came out of the same forward.
* `diagnose_workdir` / `format_diagnostics`: all of these on a workdir (`evaluate --diagnostics`).

Dimension letters (docs/dimensions.md): B batch, L row length, V vocabulary, P block offsets.
"""

from __future__ import annotations

import collections
import functools
import itertools
from typing import Any, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.data import pipeline
from sbd_jax.decode import sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.evals import results, runner
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.evals.tasks import registry
from sbd_jax.run import loading
from sbd_jax.sbd import noising, reveal_rules

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


def _decoding_layout_forward(graphdef, state, batch, masked_BL, block_size: int, mask_id: int):
  """The training forward [x ; x̂] of held-out rows with blocks where decoding puts them (from
  each completion's first token). Returns (SBDBatch, float32 logits [B, 2L, V])."""
  tokens, segs, pos, loss_mask = (
    batch[k] for k in ("tokens", "segment_ids", "positions", "loss_mask")
  )
  anchors = noising.completion_anchors(pos, segs, loss_mask)
  sbd = noising.build_sbd_batch(
    tokens, segs, pos, loss_mask, masked_BL, block_size, mask_id,
    eos_tail_BL=batch.get("eos_tail"), anchors_BL=anchors,
  )  # fmt: skip
  logits_BTV, _ = nnx.merge(graphdef, state)(sbd.inputs, sbd.meta)
  return sbd, logits_BTV.astype(jnp.float32)


def _onto_predicted_token(x_BL: jax.Array) -> jax.Array:
  """A clean-half value at position t (NTP predicting token t + 1), moved to position t + 1."""
  return jnp.pad(x_BL[:, :-1], ((0, 0), (1, 0)))


def _counted(sbd) -> jax.Array:
  """[B, L]: masked tokens with a target that NTP also predicts (same document, loss-bearing)."""
  return (sbd.matp_weights > 0) & (_onto_predicted_token(sbd.ntp_weights) > 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "block_size", "mask_id"))
def _token_losses(graphdef, state, batch, masked_BL, *, block_size: int, mask_id: int):
  """Per target token: MATP loss of its block position, NTP loss of the clean position before
  it, its offset in the block, and whether it counts (masked, loss-bearing)."""
  sbd, logits_BTV = _decoding_layout_forward(graphdef, state, batch, masked_BL, block_size, mask_id)
  tokens = batch["tokens"]
  length = tokens.shape[1]
  matp_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, length:], tokens)
  ntp_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BTV[:, :length], sbd.ntp_targets)
  offset_BL = batch["positions"] - sbd.meta.block_start[:, length:]
  return matp_BL, _onto_predicted_token(ntp_BL), offset_BL, _counted(sbd)


def loss_by_offset(
  model,
  rows: dict[str, np.ndarray],
  mask_id: int,
  *,
  block_size: int = 16,
  mask_rates: Sequence[float] = (1.0, 0.75, 0.5, 0.25),
  batch_size: int = 16,
  seed: int = 0,
) -> dict[str, Any]:
  """Mean MATP and NTP loss (nats) of the same held-out tokens, per block offset and masking
  rate (1.0 = every completion token masked, as in a decoding block's first forward)."""
  rng = np.random.default_rng(seed)
  n = len(rows["tokens"])
  out: dict[str, Any] = {"block_size": block_size, "rates": {}}
  for rate in mask_rates:
    sums = np.zeros((3, block_size))  # matp, ntp, count per offset
    for first in range(0, n, batch_size):
      batch = {k: v[first : first + batch_size] for k, v in rows.items()}
      short = batch_size - len(batch["tokens"])
      batch = {k: np.pad(v, ((0, short), (0, 0))) for k, v in batch.items()}
      masked = rng.random(batch["tokens"].shape) < rate
      matp, ntp, offset, counted = jax.device_get(
        _token_losses(
          model.graphdef, model.state, batch, masked, block_size=block_size, mask_id=mask_id
        )
      )
      for values, row in ((matp, 0), (ntp, 1), (np.ones_like(matp), 2)):
        np.add.at(sums[row], offset[counted], values[counted])
    count = np.maximum(sums[2], 1)
    out["rates"][f"{rate:g}"] = {
      "matp": (sums[0] / count).tolist(),
      "ntp_same_tokens": (sums[1] / count).tolist(),
      "tokens": sums[2].astype(int).tolist(),
      "matp_mean": float(sums[0].sum() / count.sum()),
      "ntp_mean": float(sums[1].sum() / count.sum()),
    }
  return out


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
  sbd, logits_BTV = _decoding_layout_forward(
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
  ntp_argmax_BL = _onto_predicted_token(jnp.argmax(ntp_logp, -1))
  counted_BL = _counted(sbd)
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


def reveal_groups(tokens: Sequence[int], steps: Sequence[int], tokenizer) -> list[str]:
  """One line per forward that revealed tokens: '3: " Mia| starts| with"' (| between
  tokens), in forward order."""
  by_step: dict[int, list[str]] = {}
  for token, step in zip(tokens, steps):
    by_step.setdefault(int(step), []).append(repr(tokenizer.decode([token]))[1:-1] or "<eos>")
  return [f"{step:3d}: {'|'.join(pieces)}" for step, pieces in sorted(by_step.items())]


def diagnose_workdir(
  workdir: str,
  task_name: str = "arithmetic",
  *,
  data: str | None = None,
  num_problems: int = 128,
  seed: int | None = None,
  gamma: float = 0.35,
  num_reveal_examples: int = 3,
) -> dict[str, Any]:
  """What separates a weak model from a bug (module docstring), on held-out problems: the
  built-in task's `num_problems` drawn for `seed`, or the first `num_problems` records of a
  task's JSONL file `data` that has reference completions (the `exact` task's). Prompts are
  plain (no chat template), as the training rows hold them.

  * `decoding`: NTP next to SBD with block size 1 (one masked token, NTP's context), and with
    the run's block size at γ = 0 (one token per forward) and at `gamma` (`results` rows);
  * `loss_by_offset`: MATP loss per block offset and masking rate next to NTP on the same tokens;
  * `masked_misses`: tokens a wholly masked block gets wrong where NTP is right, and how many of
    them the EB rule at `gamma` commits in the block's first forward;
  * `reveal_order`: which tokens of a few SBD answers came out of the same forward.
  """
  task = registry.get(task_name)
  if num_problems < 1:
    raise ValueError(f"num_problems must be >= 1, got {num_problems}")
  if task is arithmetic_task.TASK and data:
    raise ValueError("the arithmetic task draws its problems: give --num_problems and --seed")
  if task is not arithmetic_task.TASK and not data:
    raise ValueError(f"--task={task_name} needs --data=<its JSONL file>")
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  if task is arithmetic_task.TASK:
    seed = config.train.seed if seed is None else seed
    drawn = arithmetic_task.problems(config.data, num_problems, seed)
  else:
    seed = None
    drawn = task.load(data, num_problems)
    if any("completion" not in p.record for p in drawn):
      raise ValueError(f"diagnostics need reference completions: {data} has no 'completion'")
  records = [{"prompt": p.plain_prompt, "completion": p.record["completion"]} for p in drawn]
  s, k = config.sample, config.sample.block_size
  budget = runner.reference_budget(drawn, tokenizer, k)
  # What SBD itself predicts (plain, not verified).
  base = settings_lib.from_config(s, tokenizer, mask_id, budget=budget, mode="sbd", verify=False)
  one = reveal_rules.one_per_forward(base.rule)  # γ of one token per forward
  decodings = [
    (results.NTP, base.replace(mode="ntp")),
    (settings_lib.decoding_name(s.rule, one, 1), base.replace(block_size=1, gamma=one)),
    (settings_lib.decoding_name(s.rule, one, k), base.replace(gamma=one)),
    (settings_lib.decoding_name(s.rule, gamma, k), base.replace(gamma=gamma)),
  ]
  summary = runner.evaluate(model, tokenizer, task, drawn, decodings, batch_size=s.batch_size)
  decoding = {r["decoding"]: r for r in summary["decodings"]}
  settings = decodings[-1][1]
  shown = [r["prompt"] for r in records[:num_reveal_examples]]
  out = sampler.decode_text(model, tokenizer, shown, settings)
  # + BOS and EOS; rows this long never cut a problem
  longest = max(len(tokenizer.encode(r["prompt"] + r["completion"])) + 2 for r in records)
  rows = pack_documents(records, tokenizer, seq_len=max(config.train.seq_len, longest))
  return {
    "source": f"seed {seed}" if data is None else data,
    "num_problems": len(drawn),
    "decoding": decoding,
    "loss_by_offset": loss_by_offset(
      model, rows, mask_id, block_size=s.block_size, batch_size=s.batch_size
    ),
    "masked_misses": masked_misses(
      model,
      rows,
      mask_id,
      tokenizer,
      block_size=s.block_size,
      gamma=gamma,
      batch_size=s.batch_size,
    ),  # fmt: skip
    "reveal_order": [reveal_groups(t, r, tokenizer) for t, r in zip(out.tokens, out.reveal_step)],
  }


def format_diagnostics(d: dict[str, Any]) -> str:
  lines = [f"{d['num_problems']} held-out problems ({d['source']})", ""]
  lines.append(f"{'decoding':<32} {'accuracy %':>10} {'mean forwards':>14}")
  for name, r in d["decoding"].items():
    lines.append(f"{name:<32} {100 * r['accuracy']:>10.1f} {r['mean_nfe']:>14.1f}")
  loss = d["loss_by_offset"]
  lines += ["", f"held-out loss (nats) by offset in a block of {loss['block_size']}: MATP / NTP"]
  lines.append("mask rate " + " ".join(f"{i:>11d}" for i in range(loss["block_size"])))
  for rate, r in loss["rates"].items():
    cells = (f"{m:5.2f}/{n:<5.2f}" for m, n in zip(r["matp"], r["ntp_same_tokens"]))
    lines.append(f"{rate:>9} " + " ".join(cells))
  m = d.get("masked_misses")
  if m:
    lines += [
      "",
      f"greedy accuracy per token, block of {m['block_size']} masked whole / NTP: "
      f"{100 * m['masked_accuracy']:.2f} % / {100 * m['ntp_accuracy']:.2f} % of {m['tokens']}",
      f"tokens NTP gets right and the masked block misses: {m['misses']}; the EB rule at "
      f"γ={m['gamma']:g} commits {m['revealed_first_forward']} of them in the block's first "
      f"forward ({m['revealed_above_gamma']} with entropy above γ, mean "
      f"{m['mean_entropy_revealed']:.2f} nats)",
    ]
    lines += [
      f"  {x['token']!r} x{x['count']} (mostly as {x['predicted']!r}, mean entropy "
      f"{x['mean_entropy']:.2f})"
      for x in m["most_missed"]
    ]
  lines += ["", "reveal order of SBD answers (forward: tokens revealed together)"]
  for groups in d["reveal_order"]:
    lines += groups + [""]
  return "\n".join(lines)
