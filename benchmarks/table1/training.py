"""Training the benchmark's models: one config per (size, mode, task), reused when done."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ml_collections

from benchmarks.table1.sizes import WORD_VOCAB_SIZE, Size
from sbd_jax import config as config_lib
from sbd_jax.model import architectures
from sbd_jax.run import workdir as workdir_lib
from sbd_jax.training import trainer


def log(message: str) -> None:
  print(f"[table1] {message}", flush=True)


# ------------------------------------------------------------------------------------------
# Training.


def train_config(
  size: Size, mode: str, task: str, train_path: str = ""
) -> ml_collections.ConfigDict:
  """The run config of one model: `mode` in objective.MODES, `task` "arithmetic" or "code"."""
  c = config_lib.base_config(architectures.tiny(**size.model, compute_dtype=size.compute_dtype))
  set_here = {"sbd": {"mode"}, "optim": {"lr", "warmup_steps"}}  # from `mode` and Size fields
  for section, owned in set_here.items():
    overrides, known = getattr(size, section), c[section]
    unknown = sorted(set(overrides) - set(known) | set(overrides) & owned)
    if unknown:
      raise ValueError(
        f"Size.{section} sets fields {unknown} that config.{section} lacks or that train_config "
        f"sets itself ({sorted(owned)}); known: {sorted(known)}"
      )
    known.update(overrides)
  c.sbd.mode = mode
  arith = task == "arithmetic"
  c.train.steps = size.steps if arith else size.code_steps
  c.train.batch_size = size.batch_size if arith else size.code_batch_size
  c.train.seq_len = size.seq_len if arith else size.code_seq_len
  c.train.seed = 0
  c.train.log_every = max(1, c.train.steps // 20)
  c.optim.lr = size.lr
  c.optim.warmup_steps = min(size.warmup_steps, c.train.steps // 2)
  c.checkpoint.every_steps = max(1, c.train.steps // size.checkpoints)
  if arith:  # the word vocabulary built from the task (see configs/tiny.py)
    c.tokenizer = "words"
    c.model.vocab_size = WORD_VOCAB_SIZE
  else:
    c.data.source = "jsonl"
    c.data.paths = train_path
  c.sample.num_problems = size.num_problems
  c.sample.max_new_tokens = size.max_new_tokens
  c.sample.block_size = size.block_size
  c.sample.batch_size = size.eval_batch
  return c


def ensure_trained(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train in `workdir` unless it holds a params export of this config at c.train.steps (the
  trainer resumes from a checkpoint otherwise). A workdir trained with another config (a
  changed Size or recipe) is moved aside to `<workdir>.stale-N`, not reused and not deleted.
  Returns wall time and the last metrics record."""
  conflicts = workdir_lib.resume_conflicts(workdir, c)
  if conflicts:
    aside = _unused_name(f"{workdir}.stale")
    os.rename(workdir, aside)
    log(f"{workdir} was trained with another config ({'; '.join(conflicts[:3])}): moved to {aside}")
  done = os.path.isdir(os.path.join(workdir, "params"))
  if done:
    done = workdir_lib.read_trained_config(workdir).train.steps == c.train.steps
  t0 = time.perf_counter()
  if done:
    log(f"reusing {workdir} ({c.train.steps} steps, mode {c.sbd.mode})")
  else:
    log(
      f"training {workdir}: mode {c.sbd.mode}, {c.train.steps} steps of "
      f"{c.train.batch_size}x{c.train.seq_len}, data {c.data.source}"
    )
    trainer.train(c, workdir)
  return {
    "workdir": workdir,
    "reused": done,
    "seconds": time.perf_counter() - t0,
    "last_metrics": _last_metrics(workdir),
  }


def _unused_name(prefix: str) -> str:
  n = 0
  while os.path.exists(f"{prefix}-{n}"):
    n += 1
  return f"{prefix}-{n}"


def _last_metrics(workdir: str) -> dict[str, Any]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  return json.loads(lines[-1]) if lines else {}
