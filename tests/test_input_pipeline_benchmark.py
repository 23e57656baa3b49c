"""The input-pipeline benchmark: its rates and counts, the three stored formats giving the same
batches, and (integration) the command end to end on a tiny corpus."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import input_pipeline as ip
from sbd_jax.data import pipeline
from sbd_jax.data.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(__file__))
SEQ_LEN = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  records = ip.make_corpus(40, seed=3)
  root = str(tmp_path_factory.mktemp("corpus"))
  return records, ip.write_corpus(records, root, shards=3, row_group_rows=4)


def _batches(cfg, n):
  dataset = pipeline.make_slices_dataset(
    cfg, ByteTokenizer(), slice_rows=2, slices=[0], slice_count=1, seq_len=SEQ_LEN, seed=0
  )
  return list(itertools.islice(iter(dataset), n))


def test_rates_divide_counts_by_seconds_and_fill_by_row_tokens():
  r = ip.rates(rows=32, batches=2, tokens=48_000, seconds=4.0, seq_len=2048)
  assert r == {
    "rows_per_s": 8.0,
    "batches_per_s": 0.5,
    "tokens_per_s": 12_000.0,
    "fill": 48_000 / 65_536,
  }
  with pytest.raises(ValueError):
    ip.rates(rows=1, batches=1, tokens=1, seconds=0.0, seq_len=8)


def test_rounds_pool_counts_and_seconds_and_take_the_median_start_up():
  runs = [
    {"format": "jsonl", "workers": 4, "rows": r, "batches": r // 16, "tokens": t, "seconds": s,
     "open_s": o, "first_batch_s": 2 * o, "startup_s": 3 * o}
    for r, t, s, o in ((160, 300_000, 2.0, 0.1), (320, 600_000, 6.0, 0.3), (16, 30_000, 0.5, 0.2))
  ]  # fmt: skip
  p = ip.pool(runs, seq_len=2048)
  assert (p["format"], p["workers"], p["rounds"]) == ("jsonl", 4, 3)
  assert (p["rows"], p["batches"], p["tokens"], p["seconds"]) == (496, 31, 930_000, 8.5)
  assert p["tokens_per_s"] == 930_000 / 8.5 and p["rows_per_s"] == 496 / 8.5  # not mean rates
  assert p["fill"] == 930_000 / (496 * 2048)
  assert (p["open_s"], p["first_batch_s"], p["startup_s"]) == pytest.approx((0.2, 0.4, 0.6))


def test_batch_counts_count_segment_tokens_not_padding():
  segment_ids = np.array([[1, 1, 2, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
  assert ip.batch_counts({"segment_ids": segment_ids}) == (3, 8)


def test_the_corpus_is_deterministic_and_of_realistic_length():
  a, b = ip.make_corpus(50, seed=1), ip.make_corpus(50, seed=1)
  assert a == b and a != ip.make_corpus(50, seed=2)
  for r in a:
    assert ip.PROMPT_CHARS[0] <= len(r["prompt"]) <= ip.PROMPT_CHARS[1] + 20
    assert ip.COMPLETION_CHARS[0] <= len(r["completion"]) <= ip.COMPLETION_CHARS[1] + 20


def test_the_three_formats_give_the_same_batches(corpus):
  records, paths = corpus
  assert len(paths["parquet"].split(",")) == len(paths["array_record"].split(",")) == 3
  got = {
    fmt: _batches(ip.data_config(fmt, paths[fmt], workers=0, read_threads=2), 6)
    for fmt in ip.FORMATS
  }
  for fmt in ("parquet", "array_record"):
    for mine, theirs in zip(got[fmt], got["jsonl"]):
      for key in theirs:
        np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{fmt} {key}")
  # Each segment is a piece of one record, prompt then completion.
  texts = [r["prompt"] + r["completion"] for r in records]
  segments = 0
  for b in got["jsonl"]:
    for tokens, ids in zip(b["tokens"], b["segment_ids"]):
      for s in set(ids[ids > 0].tolist()):
        piece = ByteTokenizer().decode(tokens[ids == s])
        assert len(piece) > 0 and any(piece in t for t in texts), piece
        segments += 1
  assert segments >= 12  # every row holds at least one


def test_measure_counts_the_timed_batches_non_padding_tokens(corpus):
  _, paths = corpus
  cfg = ip.data_config("array_record", paths["array_record"], workers=0, read_threads=1)
  ticks = itertools.count()
  r = ip.measure(
    cfg, batch=2, seq_len=SEQ_LEN, warmup=3, seconds=4.5, clock=lambda: float(next(ticks))
  )
  # Clock calls: start 0, dataset built 1, first batch 2, timing from 3; a batch before each
  # check at 4, 5, ..., 8 (8 - 3 > 4.5 stops): 5 timed batches, then the end at 9.
  assert (r["open_s"], r["first_batch_s"], r["startup_s"]) == (1.0, 2.0, 3.0)
  assert r["batches"] == 5 and r["rows"] == 10 and r["seconds"] == 6.0
  timed = _batches(cfg, 3 + 5)[3:]  # the same pipeline, warm-up batches skipped
  assert r["tokens"] == sum(int((b["segment_ids"] > 0).sum()) for b in timed)
  assert r["tokens"] < r["rows"] * SEQ_LEN  # padding is not counted
  assert r["tokens_per_s"] == r["tokens"] / 6.0 and r["rows_per_s"] == 10 / 6.0
  assert r["fill"] == r["tokens"] / (10 * SEQ_LEN)


def test_table_has_a_line_per_measurement():
  row = {
    "format": "parquet", "workers": 4, "tokens_per_s": 1234567.0, "rows_per_s": 700.25,
    "batches_per_s": 43.8, "fill": 0.871, "open_s": 0.01, "first_batch_s": 3.3,
    "startup_s": 3.4, "batches": 89,
  }  # fmt: skip
  lines = ip.format_markdown([row, {**row, "format": "jsonl"}]).splitlines()
  assert len(lines) == 4
  assert lines[2] == "| parquet | 4 | 1,234,567 | 700.2 | 43.80 | 87.1 | 0.01 | 3.30 | 3.40 | 89 |"


@pytest.mark.integration  # the command, with worker processes
def test_the_command_measures_every_format_and_worker_count(tmp_path):
  out = tmp_path / "out"
  command = [
    sys.executable, "-m", "benchmarks.input_pipeline", f"--out={out}", "--workers=0,1",
    "--records=60", "--batch=2", f"--seq_len={SEQ_LEN}", "--seconds=0.3", "--warmup=2",
    "--shards=2", "--row_group_rows=8", "--rounds=1",
  ]  # fmt: skip
  result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  rows = json.loads((out / "results.json").read_text())["rows"]
  assert [(r["format"], r["workers"]) for r in rows] == [(f, w) for f in ip.FORMATS for w in (0, 1)]
  for r in rows:
    assert (
      r["rounds"] == 1
      and r["seconds"] >= 0.3
      and r["batches"] >= 1
      and r["rows"] == 2 * r["batches"]
    )
    assert 0 < r["tokens"] <= r["rows"] * SEQ_LEN
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert 0 < r["open_s"] <= r["first_batch_s"] <= r["startup_s"]
  assert len((out / "input_pipeline.md").read_text().splitlines()) == 2 + len(rows)
  assert (out / "input_pipeline.png").read_bytes()[:4] == b"\x89PNG"
  drawn = ip.plot(rows, str(tmp_path / "again.png"))  # what the figure shows
  assert drawn == {
    label: {r["format"]: r["tokens_per_s"] for r in rows if r["workers"] == w}
    for w, label in ((0, "in process"), (1, "1 worker"))
  }
