"""Held-out data for evaluation while training (`train.eval_every`).

Three places held-out documents come from, in this order:
* `eval.paths` or `eval.mixture`: files of their own (any source, fields or mixture `data`
  takes; unset fields are `data`'s);
* `data.holdout` > 0: the last N documents of each training source, kept out of training;
* the built-in arithmetic task: its eval split, disjoint from training by construction.
"""

from __future__ import annotations

import grain
import ml_collections

from sbd_jax.data import sources


def heldout_config() -> ml_collections.ConfigDict:
  """The run config's `eval` group (read only when `train.eval_every` > 0)."""
  c = ml_collections.ConfigDict()
  c.batches = 4  # global batches (train.batch_size rows each) per evaluation, the same each time
  # Held-out files: `data` fields that differ (source, paths, fields, mixture, ...); "" / ()
  # = the training data's `data.holdout` documents (or the arithmetic task's eval split).
  c.source = ""
  c.paths = ""
  c.mixture = ()
  # MATP loss per masked token at each masking rate: every maskable token of a block is masked
  # with this probability (1.0: whole blocks, as decoding starts each block).
  c.mask_rates = (0.25, 0.5, 0.75, 1.0)
  c.block_size = 0  # k of the MATP evaluation; 0 = sample.block_size (what decoding uses)
  # Held-out arithmetic problems decoded with NTP and SBD at each evaluation (accuracy and
  # forwards); 0 = none. Needs data.source = "arithmetic".
  c.decode_problems = 0
  return c


def uses_own_files(c: ml_collections.ConfigDict) -> bool:
  return bool(c.eval.paths or c.eval.mixture)


def eval_data_config(c: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, str]:
  """(data config, part) of the held-out documents: part "all" reads the config's sources
  whole, "heldout" the last `data.holdout` documents of each, "eval" the arithmetic eval split.
  DataError when the run has no held-out data."""
  data = c.data.copy_and_resolve_references()
  if uses_own_files(c):
    with data.unlocked():
      data.source = c.eval.source or data.source
      data.paths = c.eval.paths
      data.mixture = tuple(c.eval.mixture)
      data.holdout = 0
    return data, "all"
  if c.data.holdout > 0:
    return data, "heldout"
  if c.data.source == "arithmetic" and not c.data.get("mixture"):
    return data, "eval"
  raise sources.DataError(
    "train.eval_every needs held-out data: set eval.paths (or eval.mixture), or hold out "
    "documents of the training data with data.holdout=N"
  )


def split(docs: grain.MapDataset, holdout: int, part: str, name: str) -> grain.MapDataset:
  """The documents of `part` ("train": all but the last `holdout`, "heldout": those, any
  other part: every one); a one-line DataError when the source has no more than `holdout` documents."""
  if part not in ("train", "heldout") or holdout <= 0:
    return docs
  if len(docs) <= holdout:
    raise sources.DataError(
      f"data.holdout={holdout} leaves no training documents in {name} ({len(docs)} documents)"
    )
  return docs[: len(docs) - holdout] if part == "train" else docs[len(docs) - holdout :]


def validate(c: ml_collections.ConfigDict, k_min: int, k_max: int) -> str | None:
  """A one-line complaint about the held-out settings, or None."""
  if c.train.eval_every < 0:
    return f"train.eval_every must be >= 0, got {c.train.eval_every}"
  if c.data.holdout < 0:
    return f"data.holdout must be >= 0, got {c.data.holdout}"
  if not c.train.eval_every:
    return None
  e = c.eval
  if e.batches < 1:
    return f"eval.batches must be >= 1, got {e.batches}"
  rates = tuple(e.mask_rates)
  if not rates or not all(0 < r <= 1 for r in rates):
    return f"eval.mask_rates must be rates in (0, 1], got {rates}"
  block = e.block_size or c.sample.block_size
  if not k_min <= block <= k_max:
    return f"eval.block_size {block} is outside the trained block sizes [{k_min}, {k_max}]"
  if e.decode_problems < 0:
    return f"eval.decode_problems must be >= 0, got {e.decode_problems}"
  if e.decode_problems and c.data.source != "arithmetic":
    return "eval.decode_problems decodes the built-in task's problems: needs data.source=arithmetic"
  try:
    eval_data_config(c)
  except sources.DataError as err:
    return str(err)
  return None
