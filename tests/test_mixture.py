"""Weighted mixtures of sources (`data.mixture`): each host interleaves its shard of every
source by weight, deterministically; the batches resume exactly from an iterator's state and
do not depend on which process holds which row slice."""

import collections
import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from sbd_jax.data import mixture, pipeline  # noqa: E402
from sbd_jax.data.errors import DataError  # noqa: E402
from sbd_jax.data.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()


@pytest.fixture
def two_sources(tmp_path):
  """OpenMathReasoning-style parquet (problem / generated_solution) and plain-text JSONL."""
  rows = [{"problem": f"P{i}?", "generated_solution": f"S{i}."} for i in range(40)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math.parquet", row_group_size=8)
  (tmp_path / "web.jsonl").write_text(
    "".join(json.dumps({"text": f"web page {i}"}) + "\n" for i in range(25))
  )
  math = dict(
    weight=3.0, source="parquet", paths=str(tmp_path / "math.parquet"),
    fields=dict(prompt="problem", completion="generated_solution"),
  )  # fmt: skip
  web = dict(weight=1.0, source="jsonl", paths=str(tmp_path / "web.jsonl"))
  return math, web


def mixture_cfg(*parts, **kw):
  cfg = pipeline.default_data_config()
  cfg.update(kw)
  cfg.mixture = tuple(parts)
  return cfg


def test_each_host_draws_the_sources_in_the_weights_proportions(two_sources):
  cfg = mixture_cfg(*two_sources)
  source = pipeline._source(cfg, seed=0, bad_records=None)
  for host in range(2):
    docs = mixture.documents(source, cfg, 0, host, 2)
    drawn = [docs[i] for i in range(400)]
    kinds = collections.Counter("math" if "prompt" in d else "web" for d in drawn)
    assert abs(kinds["math"] / 400 - 0.75) <= 0.01, kinds
    # The field map of each source applied: math rows as prompt / completion.
    assert all(d["prompt"].startswith("P") for d in drawn if "prompt" in d)
    # Each source repeats on its own: the small web shard (13 or 12 pages) is seen again.
    webs = [d["text"] for d in drawn if "text" in d]
    assert len(set(webs)) == (13 if host == 0 else 12) < len(webs)
    others = mixture.documents(source, cfg, 0, 1 - host, 2)
    assert not {d["text"] for d in drawn if "text" in d} & {
      others[i]["text"] for i in range(400) if "text" in others[i]
    }  # hosts read disjoint shards


def test_batches_resume_exactly_and_do_not_depend_on_the_process_layout(two_sources):
  cfg = mixture_cfg(*two_sources)

  def rows(slices, n=3):
    ds = pipeline.make_slices_dataset(
      cfg, TOK, slice_rows=2, slices=slices, slice_count=2, seq_len=32, seed=3
    )
    return [next(it) for it in [iter(ds)] for _ in range(n)]

  whole, first, second = rows([0, 1]), rows([0]), rows([1])
  for w, a, b in zip(whole, first, second):
    for k in w:
      np.testing.assert_array_equal(w[k], np.concatenate([a[k], b[k]]), err_msg=k)
  it = iter(pipeline.make_slices_dataset(
    cfg, TOK, slice_rows=2, slices=[0, 1], slice_count=2, seq_len=32, seed=3
  ))  # fmt: skip
  next(it)
  state = json.loads(json.dumps(it.get_state()))  # as Orbax stores it
  expected = [next(it) for _ in range(3)]
  it.set_state(state)
  for got, want in zip([next(it) for _ in range(3)], expected):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_bad_weight_or_an_empty_source_is_one_line(two_sources, tmp_path):
  math, web = two_sources
  for weight in (0, -1.0, "1", None):
    with pytest.raises(DataError, match=r"data.mixture\[1\]: weight must be a positive number"):
      pipeline._source(mixture_cfg(math, {**web, "weight": weight}), 0, None)
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(DataError, match="no usable records"):
    pipeline._source(mixture_cfg(math, {**web, "paths": str(tmp_path / "empty.jsonl")}), 0, None)


def test_the_documents_read_per_source_are_counted_as_they_are_read(two_sources):
  cfg = mixture_cfg(*two_sources)
  counts = mixture.MixtureCounts(2)
  docs = mixture.documents(pipeline._source(cfg, 0, None), cfg, 0, 0, 1, counts)
  drawn = [docs[i] for i in range(200)]
  assert counts.counts == [sum("prompt" in d for d in drawn), sum("text" in d for d in drawn)]
  assert counts.shares() == pytest.approx({"mixture_share_0": 0.75, "mixture_share_1": 0.25})


@pytest.mark.integration  # a training run
def test_a_run_on_a_mixture_logs_the_realised_shares(two_sources, tmp_path, tiny_train_config):
  from sbd_jax.training import trainer

  c = tiny_train_config(steps=4)
  c.data.mixture = two_sources
  trainer.train(c, str(tmp_path / "run"))
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  shares = [(r["mixture_share_0"], r["mixture_share_1"]) for r in records if "loss" in r]
  assert len(shares) == 4
  assert all(abs(a - 0.75) < 0.05 and abs(a + b - 1) < 1e-9 for a, b in shares)


def test_a_mixture_with_parquet_runs_in_worker_processes(two_sources):
  """grain's worker processes get the pipeline pickled: the parquet source (its per-thread
  file cache) and the counters go without their locks and caches, and the batches are the
  in-process ones."""
  cfg = mixture_cfg(*two_sources)

  def first_batches(num_workers):
    cfg.num_workers = num_workers
    ds = pipeline.make_slices_dataset(
      cfg, TOK, slice_rows=2, slices=[0], slice_count=1, seq_len=32, seed=3,
      mixture_counts=mixture.MixtureCounts(2),
    )  # fmt: skip
    it = iter(ds)
    return [next(it) for _ in range(3)]

  for got, want in zip(first_batches(1), first_batches(0)):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
