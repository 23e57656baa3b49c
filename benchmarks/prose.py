"""A byte-level model of English prose, for timing decodes on text that no task of this project
shaped: Python's own documentation topics (`pydoc_data.topics`, shipped with every CPython).

    python -m benchmarks.prose --out=DIR [--steps=1200 --batch_size=8 --context=96]

Topics are split by name (every eighth held out) into DIR/train.jsonl, whose passages of about
PASSAGE bytes are `text` records, and DIR/held_out.jsonl, {"prompt", "completion"} records: a
held-out passage's first `--context` bytes and the CONTINUATION bytes after them. A run of
configs/paper_small.py's recipe with the byte vocabulary (`jsonl_tasks.task_config`: blocks of
16, k ~ U{2..16}) trains on the first in DIR/run. Then, e.g.:

    python -m benchmarks.decode_speed --out=OUT --models= --workdir=DIR/run --task=exact \\
        --data=DIR/held_out.jsonl --batches=1,16
"""

from __future__ import annotations

import json
import os
import re

from absl import flags

from benchmarks import jsonl_tasks
from sbd_jax import cli

PASSAGE = 600  # bytes of a training passage, about
CONTINUATION = 48  # bytes a held-out record's completion holds


def topics() -> dict[str, str]:
  """Python's documentation topics, {name: text}, whitespace runs collapsed to one space."""
  from pydoc_data import topics as pydoc_topics

  return {name: re.sub(r"\s+", " ", text).strip() for name, text in pydoc_topics.topics.items()}


def passages(text: str, size: int = PASSAGE) -> list[str]:
  """`text` cut at spaces into pieces of about `size` bytes (ASCII: one byte a character)."""
  out, start = [], 0
  while start < len(text):
    end = text.find(" ", start + size)
    end = len(text) if end < 0 else end
    out.append(text[start:end].strip())
    start = end + 1
  return [p for p in out if p]


def write_data(out: str, context: int) -> tuple[str, str]:
  """DIR/train.jsonl and DIR/held_out.jsonl (module docstring); their paths."""
  os.makedirs(out, exist_ok=True)
  train, held_out = [], []
  for i, (_, text) in enumerate(sorted(topics().items())):
    text = text.encode("ascii", "ignore").decode()
    if i % 8 == 7:
      for p in passages(text):
        if len(p) >= context + CONTINUATION:
          held_out.append(
            {"prompt": p[:context], "completion": p[context : context + CONTINUATION]}
          )
    else:
      train += [{"text": p} for p in passages(text)]
  paths = os.path.join(out, "train.jsonl"), os.path.join(out, "held_out.jsonl")
  for path, rows in zip(paths, (train, held_out)):
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return paths


def main(argv):
  del argv
  from sbd_jax.training import trainer

  f = flags.FLAGS
  try:
    if f.steps < 1 or f.context < 1:
      raise ValueError(f"--steps and --context must be >= 1, got {f.steps}, {f.context}")
  except ValueError as e:
    cli.fail(e)
  train_file, held_out = write_data(f.out, f.context)
  config = jsonl_tasks.task_config(train_file, f.steps, f.batch_size)
  trainer.train(config, os.path.join(f.out, "run"))
  print(f"trained {os.path.join(f.out, 'run')}; held-out records: {held_out}")


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Output directory (data and the run).")
  flags.DEFINE_integer("steps", 1200, "Training steps (the first 30 % NTP alone).")
  flags.DEFINE_integer("batch_size", None, "Rows per step (default: the recipe's).")
  flags.DEFINE_integer("context", 96, "Bytes of a held-out passage given as the prompt.")
  flags.mark_flags_as_required(["out"])
  cli.run(main)
