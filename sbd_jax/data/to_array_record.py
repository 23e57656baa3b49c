"""JSONL -> ArrayRecord shards, streamed: the training data a pod run reads
(`data.source="array_record"`), where every host opens only the records it trains on instead of
parsing a whole JSONL corpus into its memory.

    python -m sbd_jax.data.to_array_record --input='corpus/*.jsonl' --output=DIR/train \\
        --num_shards=64 [--text_field=text --skip_bad_records]

Every line is checked as training reads it (`sources.parse_record`) and stored as it was, so a
bad line fails here, naming file and line, not hours into a run. Shards hold consecutive records,
in input order (`DIR/train-00000-of-00064.array_record`, ...), so the converted corpus trains on
exactly the batches the JSONL source gives. They are written under temporary names and renamed
only once all are complete: an interrupted or failed conversion leaves no shard that looks
finished. Shards are written as local files (ArrayRecord cannot write to a bucket); copy them to
one and train on their gs:// paths, which ArrayRecord reads itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import flags
from tqdm import tqdm

from sbd_jax import cli
from sbd_jax.data import sources

SUFFIX = ".array_record"


def shard_paths(output: str, num_shards: int) -> list[str]:
  return [f"{output}-{i:05d}-of-{num_shards:05d}{SUFFIX}" for i in range(num_shards)]


def count_lines(files: Sequence[str]) -> int:
  """Non-blank lines: the records a conversion will write if none is bad."""
  total = 0
  for path in files:
    with open(path, "rb") as f:
      total += sum(1 for line in f if line.strip())
  return total


def convert(
  files: Sequence[str],
  output: str,
  num_shards: int,
  *,
  text_field: str = "text",
  bad: sources.BadRecords | None = None,
  progress: bool = True,
) -> list[str]:
  """Writes the records of `files` to `num_shards` shards named after `output`; their paths.
  Bad lines raise DataError (nothing is left behind), or with `bad` are skipped and counted."""
  from array_record.python.array_record_module import ArrayRecordWriter  # heavy import

  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}")
  if "://" in output:
    raise ValueError(f"--output={output}: shards are written to local files (copy them after)")
  if os.path.dirname(output):
    os.makedirs(os.path.dirname(output), exist_ok=True)
  total = count_lines(files)
  if total < num_shards:
    raise ValueError(f"{total} non-blank lines cannot fill {num_shards} shards")
  final = shard_paths(output, num_shards)
  temporary = [f"{path}.incomplete" for path in final]
  writers, written = [], 0
  try:
    records = sources.iter_jsonl(files, text_field, bad)
    with tqdm(total=total, unit="record", disable=not progress, file=sys.stderr) as bar:
      for shard, path in enumerate(temporary):
        writer = ArrayRecordWriter(path, "group_size:1")  # random access: one record a chunk
        writers.append(writer)
        end = total * (shard + 1) // num_shards  # consecutive lines: shard i of the count
        for index, line, _ in records:
          writer.write(line)  # the line as it was, read back with data.text_field
          written += 1
          bar.update(1)
          if index >= end:
            break
        writer.close()
    if not written:
      raise sources.DataError(f"no usable records in {len(files)} files")
  except BaseException:
    for writer in writers:
      writer.close()
    for path in temporary:
      if os.path.exists(path):
        os.remove(path)
    raise
  for src, dst in zip(temporary, final):
    os.replace(src, dst)
  return final


def _define_flags():
  flags.DEFINE_string("input", None, "JSONL files: comma-separated local globs.")
  flags.DEFINE_string("output", None, "Shard path prefix: PREFIX-00000-of-0000N.array_record.")
  flags.DEFINE_integer("num_shards", 16, "Shards (at least the number of hosts that read).")
  flags.DEFINE_string("text_field", "text", "Field of plain-text records (as data.text_field).")
  flags.DEFINE_bool("skip_bad_records", False, "Skip and count bad lines instead of stopping.")
  flags.mark_flags_as_required(["input", "output"])


def main(argv):
  del argv
  f = flags.FLAGS
  bad = sources.BadRecords() if f.skip_bad_records else None
  try:
    files = sources.expand_paths(f.input)
    paths = convert(files, f.output, f.num_shards, text_field=f.text_field, bad=bad)
  except (OSError, ValueError) as e:  # DataError is a ValueError
    cli.fail(e)
  skipped = (
    f", {bad.count} bad lines skipped (first: {bad.examples[0]})" if bad and bad.count else ""
  )
  print(f"wrote {len(paths)} shards from {len(files)} files{skipped}")
  print(
    f"train on them with --config.data.source=array_record "
    f"--config.data.paths='{f.output}-*-of-{f.num_shards:05d}{SUFFIX}'"
  )


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
