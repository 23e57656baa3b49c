"""Input-pipeline throughput per host: the training pipeline (`data.pipeline.make_slices_dataset`,
as the trainer calls it: read records, tokenize, pack rows, batch, with grain) reading one
synthetic corpus stored three ways, JSONL, parquet and ArrayRecord, in process and with worker
processes (`data.num_workers`).

    python -m benchmarks.input_pipeline --out=DIR [--formats=jsonl,parquet,array_record]
        [--workers=1,4] [--batch=16 --seq_len=2048] [--records=4000 --seconds=4]
        [--warmup=8 --rounds=2 --read_threads=2 --shards=4 --row_group_rows=250]

The corpus: `--records` prompt/completion records of word-like text (prompts 200-800
characters, completions 300-2000; the same for a seed), written as `--shards` JSONL files,
as many parquet files of `--row_group_rows`-row row groups (pyarrow), and as many ArrayRecord
shards (`data.to_array_record.convert` of the JSONL files). The three hold the same records in
the same order, so at a worker count they give the same batches. The byte tokenizer; the data
defaults otherwise (shuffled, first-fit packing, repeated forever). Per (format, workers):
- open s: building the dataset (JSONL parses every line here; parquet reads its footers);
- first batch s: from the start to the first batch in hand, what a run waits before its first
  step; start-up s: to the end of the `--warmup` batches that are not timed (worker processes
  start, read-ahead fills);
- then batches are read as fast as they come for at least `--seconds`: rows, batches and
  non-padding tokens (segment id > 0) per second, and the share of row tokens that are not
  padding.
Every (format, workers) is measured once per round, `--rounds` rounds, its timed counts and
seconds pooled (start-up times: the median).
Outputs: DIR/results.json (`rows`), DIR/input_pipeline.md, DIR/input_pipeline.png.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import flags

from benchmarks import report
from sbd_jax import cli
from sbd_jax.data import pipeline, to_array_record
from sbd_jax.data.tokenizer import ByteTokenizer

FORMATS = ("jsonl", "parquet", "array_record")
PROMPT_CHARS = (200, 800)
COMPLETION_CHARS = (300, 2000)
_SYLLABLES = "ka lo mi re tu sa ne vo pi da el an or is um th qu st br fl".split()


def _words(rng: np.random.Generator, n: int = 600) -> list[str]:
  """A vocabulary of `n` word-like strings of 1-4 syllables."""
  return ["".join(rng.choice(_SYLLABLES, rng.integers(1, 5))) for _ in range(n)]


def _text(rng: np.random.Generator, words: Sequence[str], chars: int) -> str:
  """Sentences of `words` (and now and then a number) cut at a word boundary near `chars`."""
  picks = rng.integers(0, len(words), chars // 4 + 8)
  out, size = [], 0
  for i, w in enumerate(picks):
    word = str(rng.integers(0, 10_000)) if w % 17 == 0 else words[w]
    if i % 11 == 10:
      word += "."
    out.append(word)
    size += len(word) + 1
    if size >= chars:
      break
  return " ".join(out)


def make_corpus(records: int, seed: int = 0) -> list[dict[str, str]]:
  """`records` prompt/completion records, deterministic given `seed`."""
  rng = np.random.default_rng(seed)
  words = _words(rng)
  return [
    {
      "prompt": _text(rng, words, int(rng.integers(*PROMPT_CHARS))) + "?",
      "completion": " " + _text(rng, words, int(rng.integers(*COMPLETION_CHARS))),
    }
    for _ in range(records)
  ]


def _split(records: Sequence[Any], shards: int) -> list[Sequence[Any]]:
  """Consecutive parts, as `to_array_record.convert` cuts its shards."""
  n = len(records)
  return [records[n * i // shards : n * (i + 1) // shards] for i in range(shards)]


def write_corpus(
  records: Sequence[dict[str, str]], root: str, *, shards: int, row_group_rows: int
) -> dict[str, str]:
  """The corpus as JSONL, parquet and ArrayRecord files under `root`: `data.paths` per format."""
  import pyarrow as pa  # heavy imports
  import pyarrow.parquet as pq

  os.makedirs(root, exist_ok=True)
  jsonl, parquet = [], []
  for i, part in enumerate(_split(records, shards)):
    jsonl.append(os.path.join(root, f"corpus-{i:05d}.jsonl"))
    with open(jsonl[-1], "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in part)
    parquet.append(os.path.join(root, f"corpus-{i:05d}.parquet"))
    pq.write_table(pa.Table.from_pylist(list(part)), parquet[-1], row_group_size=row_group_rows)
  arrays = to_array_record.convert(jsonl, os.path.join(root, "corpus"), shards, progress=False)
  return {"jsonl": ",".join(jsonl), "parquet": ",".join(parquet), "array_record": ",".join(arrays)}


def data_config(source: str, paths: str, *, workers: int, read_threads: int):
  """The data defaults, reading `paths` as `source` with `workers` worker processes."""
  cfg = pipeline.default_data_config()
  cfg.source, cfg.paths = source, paths
  cfg.num_workers, cfg.read_threads = workers, read_threads
  return cfg


def batch_counts(batch: dict[str, np.ndarray]) -> tuple[int, int]:
  """(rows, non-padding tokens) of a batch."""
  return int(batch["segment_ids"].shape[0]), int(np.count_nonzero(batch["segment_ids"]))


def rates(*, rows: int, batches: int, tokens: int, seconds: float, seq_len: int) -> dict:
  """Counts read in `seconds` -> per-second rates, and the non-padding share of row tokens."""
  if seconds <= 0 or rows <= 0:
    raise ValueError(f"rates need a positive time and rows, got {seconds} s and {rows} rows")
  return {
    "rows_per_s": rows / seconds,
    "batches_per_s": batches / seconds,
    "tokens_per_s": tokens / seconds,
    "fill": tokens / (rows * seq_len),
  }


def _close(iterator: Any) -> None:
  """Stops an iterator's worker processes and threads, where it has any."""
  close = getattr(iterator, "close", None)
  if close is not None:
    close()


def measure(
  cfg: ml_collections.ConfigDict,
  *,
  batch: int,
  seq_len: int,
  warmup: int,
  seconds: float,
  seed: int = 0,
  clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
  """One (format, workers) measurement; see the module docstring."""
  t0 = clock()
  dataset = pipeline.make_slices_dataset(
    cfg, ByteTokenizer(), slice_rows=batch, slices=[0], slice_count=1, seq_len=seq_len, seed=seed
  )
  open_s = clock() - t0
  iterator = iter(dataset)
  try:
    next(iterator)
    first_s = clock() - t0
    for _ in range(warmup - 1):
      next(iterator)
    start = clock()
    rows = batches = tokens = 0
    while batches == 0 or clock() - start < seconds:
      r, t = batch_counts(next(iterator))
      rows, batches, tokens = rows + r, batches + 1, tokens + t
    elapsed = clock() - start
  finally:
    _close(iterator)
  return {
    "format": cfg.source,
    "workers": cfg.num_workers,
    "open_s": open_s,
    "first_batch_s": first_s,
    "startup_s": start - t0,
    "rows": rows,
    "batches": batches,
    "tokens": tokens,
    "seconds": elapsed,
    **rates(rows=rows, batches=batches, tokens=tokens, seconds=elapsed, seq_len=seq_len),
  }


def pool(runs: Sequence[dict[str, Any]], seq_len: int) -> dict[str, Any]:
  """Measurements of one (format, workers) in several rounds as one: counts and timed seconds
  summed and the rates of the sums; open, first-batch and start-up seconds the median."""
  sums = {k: sum(r[k] for r in runs) for k in ("rows", "batches", "tokens", "seconds")}
  return {
    "format": runs[0]["format"],
    "workers": runs[0]["workers"],
    **{k: float(np.median([r[k] for r in runs])) for k in ("open_s", "first_batch_s", "startup_s")},
    "rounds": len(runs),
    **sums,
    **rates(**sums, seq_len=seq_len),
  }


def measure_all(
  paths: dict[str, str],
  *,
  formats: Sequence[str],
  workers: Sequence[int],
  read_threads: int,
  rounds: int = 1,
  log=print,
  **kwargs,
) -> list[dict[str, Any]]:
  """`measure` for every format at every worker count, `rounds` times over (each round all of
  them once, so that a change in the machine's load falls on all alike), pooled."""
  runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
  for i in range(rounds):
    for fmt in formats:
      for w in workers:
        cfg = data_config(fmt, paths[fmt], workers=w, read_threads=read_threads)
        r = measure(cfg, **kwargs)
        log(
          f"round {i + 1}/{rounds}, {fmt}, {_workers_label(w)}: "
          f"{r['tokens_per_s']:,.0f} tokens/s, {r['rows_per_s']:.1f} rows/s, "
          f"{r['batches_per_s']:.2f} batches/s ({r['batches']} batches in {r['seconds']:.1f} s); "
          f"first batch {r['first_batch_s']:.2f} s, start-up {r['startup_s']:.2f} s"
        )
        runs.setdefault((fmt, w), []).append(r)
  return [pool(group, kwargs["seq_len"]) for group in runs.values()]


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  header = [
    "format",
    "workers",
    "tokens/s",
    "rows/s",
    "batches/s",
    "non-padding %",
    "open s",
    "first batch s",
    "start-up s",
    "timed batches",
  ]
  body = [
    [
      r["format"],
      str(r["workers"]),
      f"{r['tokens_per_s']:,.0f}",
      f"{r['rows_per_s']:.1f}",
      f"{r['batches_per_s']:.2f}",
      f"{100 * r['fill']:.1f}",
      f"{r['open_s']:.2f}",
      f"{r['first_batch_s']:.2f}",
      f"{r['startup_s']:.2f}",
      str(r["batches"]),
    ]
    for r in rows
  ]
  return report.table(header, body)


def _workers_label(workers: int) -> str:
  return {0: "in process", 1: "1 worker"}.get(workers, f"{workers} workers")


def plot(rows: Sequence[dict[str, Any]], path: str) -> dict[str, dict[str, list[float]]]:
  """Bars of tokens per second per format, one colour per worker count. Returns what it drew:
  {workers label: {format: height}}."""
  formats = list(dict.fromkeys(r["format"] for r in rows))
  workers = sorted({r["workers"] for r in rows})
  width = 0.8 / len(workers)
  with report.figure(path, 1, size=(6, 3.8)) as (ax,):
    for j, w in enumerate(workers):
      by = {r["format"]: r["tokens_per_s"] for r in rows if r["workers"] == w}
      xs = [i + (j - (len(workers) - 1) / 2) * width for i, f in enumerate(formats) if f in by]
      ax.bar(xs, [by[f] for f in formats if f in by], width, label=_workers_label(w))
    ax.set_xticks(range(len(formats)), formats)
    ax.set_ylabel("non-padding tokens per second")
    ax.set_title("input pipeline throughput, one host")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return {  # a bar's centre is its format's position, give or take half a slot
      c.get_label(): {formats[round(p.get_x() + p.get_width() / 2)]: p.get_height() for p in c}
      for c in ax.containers
    }


def _define_flags():
  flags.DEFINE_string("out", None, "Output directory (results.json, input_pipeline.md/.png).")
  flags.DEFINE_list("formats", list(FORMATS), "Stored formats read (data.source).")
  flags.DEFINE_list("workers", ["1", "4"], "data.num_workers values (0: in process).")
  flags.DEFINE_integer("batch", 16, "Rows per batch.")
  flags.DEFINE_integer("seq_len", 2048, "Tokens per row.")
  flags.DEFINE_integer("records", 4000, "Records in the corpus.")
  flags.DEFINE_integer("seed", 0, "Corpus and data seed.")
  flags.DEFINE_integer("shards", 4, "Files per format.")
  flags.DEFINE_integer("row_group_rows", 250, "Rows per parquet row group.")
  flags.DEFINE_integer("read_threads", 2, "data.read_threads.")
  flags.DEFINE_integer("warmup", 8, "Batches read before timing (the first one included).")
  flags.DEFINE_float("seconds", 4.0, "Timed seconds per measurement (at least one batch).")
  flags.DEFINE_integer("rounds", 2, "Measurements of each (format, workers), pooled.")
  flags.DEFINE_string("corpus_dir", None, "Where to write the corpus (default: a temporary one).")
  flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    workers = [int(w) for w in f.workers]
    unknown = set(f.formats) - set(FORMATS)
    if unknown or not f.formats:
      raise ValueError(f"--formats must be among {FORMATS}, got {f.formats}")
    if min(workers, default=-1) < 0 or min(f.batch, f.seq_len, f.warmup, f.shards, f.rounds) < 1:
      raise ValueError(
        "--workers must be >= 0; --batch, --seq_len, --warmup, --shards, --rounds >= 1"
      )
    if f.records < f.shards or f.seconds <= 0 or f.row_group_rows < 1:
      raise ValueError("--records >= --shards, --seconds > 0 and --row_group_rows >= 1")
  except ValueError as e:
    cli.fail(e)
  start = time.perf_counter()

  def log(message: str) -> None:
    print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

  with tempfile.TemporaryDirectory() as tmp:
    root = f.corpus_dir or tmp
    records = make_corpus(f.records, f.seed)
    paths = write_corpus(records, root, shards=f.shards, row_group_rows=f.row_group_rows)
    size = sum(os.path.getsize(p) for p in paths["jsonl"].split(","))
    log(f"corpus: {len(records)} records, {size / 1e6:.1f} MB of JSONL, in {root}")
    rows = measure_all(
      paths, formats=f.formats, workers=workers, read_threads=f.read_threads, rounds=f.rounds,
      log=log,
      batch=f.batch, seq_len=f.seq_len, warmup=f.warmup, seconds=f.seconds, seed=f.seed,
    )  # fmt: skip
  results = {
    "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
    "batch": f.batch,
    "seq_len": f.seq_len,
    "records": f.records,
    "corpus_bytes": size,
    "seconds": time.perf_counter() - start,
    "rows": rows,
  }
  table = format_markdown(rows)
  report.save(f.out, "input_pipeline", results, table, lambda path: plot(rows, path))
  print(table)
  log(f"wrote {f.out}/results.json, input_pipeline.md, input_pipeline.png")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
