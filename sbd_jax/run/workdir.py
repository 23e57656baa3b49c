"""A run's directory (a training workdir): its layout, its config and its data layout.

config.json          the run's config (written once; sampling rebuilds the model from it)
data_layout.json     processes and batch row shards the checkpoints' data positions are for
tokenizer/           the "words" vocabulary, when config.tokenizer is "words"
checkpoints/<step>/  train state + data iterator (`sbd_jax.run.checkpointing`)
params/              the latest params-only export (what `sample`, `evaluate`, `convert` load)
metrics.jsonl        logged metrics (`sbd_jax.training.metrics`)

`sbd_jax.run.loading` loads params/ as a model to sample from.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections

from sbd_jax import config as config_lib
from sbd_jax import paths
from sbd_jax.run import checkpointing

CONFIG_FILE = "config.json"
DATA_LAYOUT_FILE = "data_layout.json"


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  root = paths.resolve(workdir)
  root.mkdir(parents=True, exist_ok=True)
  (root / CONFIG_FILE).write_text(config.to_json_best_effort(indent=2))


def data_layout(processes: int, row_shards: int) -> dict[str, int]:
  """What a checkpoint's data-iterator positions depend on: each process saves the positions
  of the row slices it reads, and a batch is cut into `row_shards` (data x fsdp) slices."""
  return {"processes": int(processes), "row_shards": int(row_shards)}


def write_data_layout(workdir: str, layout: dict[str, int]) -> None:
  (paths.resolve(workdir) / DATA_LAYOUT_FILE).write_text(json.dumps(layout) + "\n")


def data_layout_conflict(workdir: str, layout: dict[str, int]) -> str | None:
  """The one-line refusal of a resume whose data layout is not the checkpoints' (their Grain
  positions would land on other row slices, repeating or skipping documents); None if it is,
  or if the workdir records none."""
  path = paths.resolve(workdir) / DATA_LAYOUT_FILE
  if not path.exists():
    return None
  saved = json.loads(path.read_text())
  if saved == layout:
    return None
  show = lambda d: f"{d['processes']} process(es) x {d['row_shards']} row shards"  # noqa: E731
  return (
    f"{workdir}'s checkpoints hold data positions for {show(saved)} (data x fsdp); this run has "
    f"{show(layout)}: resume with the same process count and data x fsdp, or train in a new "
    "workdir"
  )


# Fields a resumed run may change: how long, where and how it runs, not what it learns. Any
# other difference means the checkpoints belong to another run (`resume_conflicts`).
RESUMABLE_FIELDS = (
  "checkpoint",
  "compile_cache",
  "eval",
  "train.eval_every",
  "mesh",
  "sample",
  "model.attention_impl",
  "model.attention_chunk",
  "model.remat",
  # not data.num_workers: the saved data-iterator state holds one position per worker process,
  # and grain cannot restore it into another number of workers (nor would the stream match)
  "data.read_threads",
  "data.skip_bad_records",
  "data.tfds_data_dir",
  "train.steps",
  "train.max_hours",
  "train.log_every",
  "train.progress_bar",
  "train.wandb_project",
  "train.peak_tflops_per_device",
  "train.skip_nonfinite_steps",
  "train.loss_chunk",
  "train.init_from",
  "train.pretrained",
)


def _flat(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{"a.b": value} with JSON values (tuples as lists), as config.json stores them."""
  out: dict[str, Any] = {}

  def walk(node: dict[str, Any], prefix: str) -> None:
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, f"{prefix}{key}.")
      else:
        out[f"{prefix}{key}"] = value

  walk(json.loads(config.to_json_best_effort()), "")
  return out


_MISSING = object()  # a field one config lacks


def config_differences(
  saved: ml_collections.ConfigDict,
  requested: ml_collections.ConfigDict,
  ignore: tuple[str, ...] = (),
) -> list[str]:
  """One `field: saved -> requested` line per field the two configs set differently (a field
  only one of them has included), leaving out the fields (or whole sections) in `ignore`."""
  old, new = _flat(saved), _flat(requested)

  def ignored(key: str) -> bool:
    return any(key == field or key.startswith(field + ".") for field in ignore)

  return [
    f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
    for key in sorted(set(old) | set(new))
    if not ignored(key) and old.get(key, _MISSING) != new.get(key, _MISSING)
  ]


def resume_conflicts(workdir: str, requested: ml_collections.ConfigDict) -> list[str]:
  """Differences between the run saved in `workdir` and `requested` that a resume must not
  paper over (model, objective, data, optimizer, seed, batch shape); [] when there is no saved
  config."""
  if not (paths.resolve(workdir) / CONFIG_FILE).exists():
    return []
  saved = read_config(workdir)
  old, new, defaults = _flat(saved), _flat(requested), _flat(config_lib.base_config())

  def added_since(key: str) -> bool:  # a field the run predates, requested at its default
    return key not in old and new.get(key) == defaults.get(key, _MISSING)

  return [
    line
    for line in config_differences(saved, requested, RESUMABLE_FIELDS)
    if not added_since(line.split(":", 1)[0])
  ]


def read_config(workdir: str) -> ml_collections.ConfigDict:
  path = paths.resolve(workdir) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {workdir!r} a training workdir?")
  raw: dict[str, Any] = json.loads(path.read_text())
  return ml_collections.ConfigDict(raw)


def read_trained_config(workdir: str) -> ml_collections.ConfigDict:
  """The run config of a workdir that holds a params export; one-line errors otherwise."""
  if not workdir or not paths.resolve(workdir).is_dir():
    raise FileNotFoundError(f"workdir {workdir!r} does not exist")
  params_path = paths.resolve(workdir) / checkpointing.PARAMS_DIR
  if not params_path.is_dir():
    raise FileNotFoundError(
      f"no params export at {params_path}: train first (the trainer exports params at the end)"
    )
  return read_config(workdir)
