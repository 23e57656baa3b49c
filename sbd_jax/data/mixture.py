"""Weighted mixtures of sources (`data.mixture`): each source read with its own fields, each
host's shard of every source shuffled and repeated on its own, then interleaved by weight
(grain's `MapDataset.mix`: deterministic, so batches resume exactly), and the documents read per
source counted for the realised shares."""

from __future__ import annotations

import functools
import threading
from typing import Any

import grain

from sbd_jax.data import heldout, sources


def sources_of(
  data_cfg, data_seed: int, bad, part: str = "train"
) -> list[tuple[grain.MapDataset, float]]:
  """(documents, weight) of each source of `data_cfg.mixture` (its `part`, `heldout.split`);
  one-line DataError for a weight that is not positive or a source without records."""
  parts = []
  for i, entry in enumerate(data_cfg.mixture):
    overrides = dict(entry)
    weight = overrides.pop("weight", None)
    if not isinstance(weight, (int, float)) or not weight > 0:
      raise sources.DataError(
        f"data.mixture[{i}]: weight must be a positive number, got {weight!r}"
      )
    cfg = data_cfg.copy_and_resolve_references()
    cfg.mixture = ()
    cfg.update(overrides)
    split = "eval" if part == "eval" else "train"
    docs = grain.MapDataset.source(sources.make_source(cfg, data_seed, bad, split))
    if len(docs) == 0:
      raise sources.DataError(f"data.mixture[{i}] ({cfg.source} {cfg.paths!r}) has no records")
    docs = heldout.split(docs, cfg.get("holdout", 0), part, f"data.mixture[{i}]")
    parts.append((docs, float(weight)))
  return parts


class MixtureCounts:
  """Documents of each mixture source read by this process, as they are read (prefetching
  reads a little ahead of training): the realised shares the trainer logs."""

  def __init__(self, sources_count: int):
    self.counts = [0] * sources_count
    self._lock = threading.Lock()  # records are read by several Grain threads

  def take(self, tagged: tuple[int, Any]) -> Any:
    index, record = tagged
    with self._lock:
      self.counts[index] += 1
    return record

  def shares(self) -> dict[str, float]:
    total = sum(self.counts)
    return {f"mixture_share_{i}": c / total for i, c in enumerate(self.counts)} if total else {}

  def __getstate__(self) -> dict:  # to grain's worker processes, whose counts stay there
    return {"counts": list(self.counts)}

  def __setstate__(self, state: dict) -> None:
    self.counts, self._lock = state["counts"], threading.Lock()


def _untag(tagged: tuple[int, Any]) -> Any:
  return tagged[1]


def documents(
  source, data_cfg, data_seed: int, shard_index: int, shard_count: int, counts=None
) -> grain.MapDataset:
  """Shard `shard_index` of the documents, shuffled and repeated; of a mixture, each source's
  shard on its own, then interleaved by weight (and counted in `counts`)."""
  mixture = source if isinstance(source, list) else [(source, None)]
  parts = []
  for i, (docs, _) in enumerate(mixture):
    ds = docs[shard_index::shard_count]  # disjoint documents per shard
    if len(ds) == 0:
      raise sources.DataError(f"shard {shard_index}/{shard_count} has no documents")
    if data_cfg.shuffle:
      ds = ds.shuffle(seed=(data_seed + 7919 * i) % 2**32)
    if len(mixture) == 1:
      return ds.repeat(data_cfg.num_epochs)
    parts.append(ds.repeat(None).map(functools.partial(_tag, i)))
  mixed = grain.MapDataset.mix(parts, [weight for _, weight in mixture])
  return mixed.map(counts.take if counts is not None else _untag)


def _tag(index: int, record: Any) -> tuple[int, Any]:
  return index, record
