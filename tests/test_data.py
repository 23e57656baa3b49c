"""Arithmetic task, sources, packing invariants, determinism and iterator checkpointing."""

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import grain
import numpy as np
import pytest

from sbd_jax.data import arithmetic, pipeline, sources
from sbd_jax.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")


def _cfg(**overrides):
  cfg = pipeline.default_data_config()
  cfg.update(overrides)
  return cfg


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _segments(row):
  """[(tokens, loss_mask, positions)] per segment of one packed row, in order."""
  out = []
  for s in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
    m = row["segment_ids"] == s
    out.append((row["tokens"][m], row["loss_mask"][m], row["positions"][m]))
  return out


# ---------------------------------------------------------------- arithmetic


def _recompute(problem, difficulty=arithmetic.DEFAULT_DIFFICULTY):
  """Answer recomputed from the question alone (independent of the worked solution)."""
  numbers = [int(n) for n in re.findall(r"\d+", problem.prompt)]
  events = re.findall(
    r"(buys|finds|gets|wins|gives \w+ \d+|gives \d+|loses|sells|takes|uses|drops)", problem.prompt
  )
  total, ops = numbers[0], 0
  assert difficulty.min_total <= total <= difficulty.max_total
  for event, n in zip(events, numbers[1:]):
    gain = event.startswith(("buys", "finds", "gets", "wins")) or (
      event.startswith("gives") and not event[6].isdigit()  # "X gives her 5": a gain
    )
    total = total + n if gain else total - n
    assert difficulty.min_total <= total <= difficulty.max_total
    assert difficulty.min_operand <= n <= difficulty.max_operand
    ops += 1
  assert difficulty.min_ops <= ops <= difficulty.max_ops, problem
  return total


@pytest.mark.parametrize("solution", arithmetic.SOLUTION_STYLES)
def test_arithmetic_problems_are_correct_and_gsm8k_shaped(solution):
  difficulty = arithmetic.Difficulty(solution=solution)
  for split, n in (("train", 1500), ("eval", 300)):
    for i in range(n):
      p = arithmetic.generate(split, i, seed=3, difficulty=difficulty)
      assert _recompute(p) == p.answer, p
      assert arithmetic.extract_answer(p.completion) == p.answer
      assert arithmetic.check_worked_solution(p), p
      assert p.prompt.startswith("Q: ") and p.prompt.endswith("\nA:")
      assert p.completion.endswith(f" The answer is {p.answer}.")


def test_difficulty_knobs_are_honoured():
  hard = arithmetic.Difficulty(
    min_ops=4, max_ops=5, min_operand=20, max_operand=60, min_total=100, max_total=300
  )
  for i in range(300):
    p = arithmetic.generate("train", i, seed=0, difficulty=hard)
    assert _recompute(p, hard) == p.answer
    assert 4 <= len(re.findall(r"\bso\b", p.completion)) <= 5
  with pytest.raises(ValueError, match="min_ops"):
    arithmetic.Difficulty(min_ops=3, max_ops=2)
  with pytest.raises(ValueError, match="room for one operation"):
    arithmetic.Difficulty(min_operand=50, max_operand=60, min_total=10, max_total=59)
  assert arithmetic.Difficulty.of(pipeline.default_data_config().arithmetic) == (
    arithmetic.DEFAULT_DIFFICULTY
  )
  with pytest.raises(ValueError, match="solution must be one of"):
    arithmetic.Difficulty(solution="prose")
  # A config saved before the `solution` knob trained on sentences and still evaluates on them.
  saved = pipeline.default_data_config().arithmetic.to_dict()
  del saved["solution"]
  old = arithmetic.Difficulty.of(types.SimpleNamespace(**saved))
  assert old.solution == "sentences"
  assert " starts with " in arithmetic.generate("eval", 0, 0, old).completion


def test_check_worked_solution_catches_errors():
  p = arithmetic.generate("eval", 0, seed=0)
  assert arithmetic.check_worked_solution(p)
  wrong = p.completion.replace(f"The answer is {p.answer}.", f"The answer is {p.answer + 1}.")
  assert not arithmetic.check_worked_solution(dataclasses.replace(p, completion=wrong))
  res = re.search(r"so \d+[-+]\d+=(\d+)\.", p.completion).group(1)
  bad = p.completion.replace(f"={res}.", f"={int(res) + 10}.", 1)
  assert not arithmetic.check_worked_solution(dataclasses.replace(p, completion=bad))
  column = re.search(r": \d+[-+]\d+=(\d+),", p.completion)
  bad_column = p.completion.replace(column.group(0), column.group(0).replace("=", "=1"), 1)
  assert not arithmetic.check_worked_solution(dataclasses.replace(p, completion=bad_column))
  sentences = arithmetic.generate("eval", 0, 0, arithmetic.Difficulty(solution="sentences"))
  assert arithmetic.check_worked_solution(sentences)
  lhs, op, rhs, res = re.search(r"(\d+) ([-+]) (\d+) = (\d+)", sentences.completion).groups()
  bad = sentences.completion.replace(f"= {res} ", f"= {int(res) + 10} ", 1)
  assert not arithmetic.check_worked_solution(dataclasses.replace(sentences, completion=bad))


def test_column_working_computes_the_operation():
  """Every step is true single-digit arithmetic with the carry or borrow of the step before,
  and the steps' last digits, highest carry first, spell the result."""
  for a in range(10, 300, 7):
    for b in range(0, 120, 3):
      for op, want in (("+", a + b), ("-", a - b)):
        if want < 0:
          continue
        steps = arithmetic._columns(a, op, b).split(", ")
        carry, digits = 0, []
        for i, step in enumerate(steps):
          lhs, value = step.split("=")
          terms = [int(t) for t in re.split(r"[-+]", lhs)]
          assert terms[1] == b // 10**i % 10 and terms[0] % 10 == a // 10**i % 10
          assert eval(lhs) == int(value) and (i == 0 or terms[2] == carry), (a, op, b, step)
          assert 0 <= int(value) <= 19
          carry = int(value) // 10 if op == "+" else int(terms[0] >= 10)
          digits.append(int(value) % 10)
        assert int("".join(map(str, [carry] * (op == "+") + digits[::-1]))) == want


def test_arithmetic_is_deterministic_and_seeded():
  a = [arithmetic.generate("train", i, 0) for i in range(50)]
  assert a == [arithmetic.generate("train", i, 0) for i in range(50)]
  assert a != [arithmetic.generate("train", i, 1) for i in range(50)]


def test_arithmetic_splits_are_disjoint_across_seeds():
  """No held-out problem's arithmetic (start value and every operation) is a training
  problem's, under any wording or seed; the eval draws differ between seeds."""

  def signature(p):
    return (re.findall(r"\d+", p.prompt)[0], *re.findall(r"so \d+([-+])(\d+)=", p.completion))

  train = {signature(arithmetic.generate("train", i, s)) for s in (0, 1) for i in range(3000)}
  held_out = {
    s: {signature(arithmetic.generate("eval", i, s)) for i in range(1000)} for s in (0, 1, 7)
  }
  # The held-out pool is finite (1/16 of all signatures), so a draw repeats a few of them.
  assert all(len(h) > 900 for h in held_out.values())
  assert not train & set.union(*held_out.values())
  assert len(held_out[0] & held_out[7]) < 100  # another seed is another draw


def test_extract_answer():
  assert arithmetic.extract_answer(" 3 + 4 = 7 pens. The answer is 7.") == 7
  assert arithmetic.extract_answer("The answer is 12. The answer is 5.") == 12
  assert arithmetic.extract_answer("The answer is -3.") == -3
  assert arithmetic.extract_answer(" 3 + 4 = 7 pens. The answer is") is None
  assert arithmetic.extract_answer("") is None
  with pytest.raises(ValueError, match="unknown arithmetic split"):
    arithmetic.generate("test", 0, 0)


def test_make_eval_problems():
  probs = pipeline.make_eval_problems(_cfg(), n=20, seed=0)
  assert probs == [arithmetic.generate("eval", i, 0) for i in range(20)]
  with pytest.raises(ValueError, match="arithmetic"):
    pipeline.make_eval_problems(_cfg(source="jsonl"), n=2, seed=0)


# ---------------------------------------------------------------- encoding and packing

_RECORDS = [
  {"text": "x" * n + str(i)} for i, n in enumerate([3, 40, 7, 90, 1, 15, 33, 0, 64, 5])
] + [{"prompt": f"Q{i}?", "completion": f" a{i}" * (i + 1)} for i in range(8)]


def test_encode_record_masks():
  text = pipeline.encode_record({"text": "hi"}, TOK, prompt_loss=False)
  np.testing.assert_array_equal(text["tokens"], [TOK.bos_id, 104, 105, TOK.eos_id])
  np.testing.assert_array_equal(text["loss_mask"], [0, 1, 1, 1])
  sft = pipeline.encode_record({"prompt": "ab", "completion": "c"}, TOK, prompt_loss=False)
  np.testing.assert_array_equal(sft["tokens"], [TOK.bos_id, 97, 98, 99, TOK.eos_id])
  np.testing.assert_array_equal(sft["loss_mask"], [0, 0, 0, 1, 1])
  sft = pipeline.encode_record({"prompt": "ab", "completion": "c"}, TOK, prompt_loss=True)
  np.testing.assert_array_equal(sft["loss_mask"], [0, 1, 1, 1, 1])
  assert text["tokens"].dtype == np.int32 and text["loss_mask"].dtype == np.int32


def _packed_rows(packing, seq_len=32, records=_RECORDS, prompt_loss=False):
  docs = (
    grain.MapDataset.source(sources.ListSource(records))
    .map(lambda r: pipeline.encode_record(r, TOK, prompt_loss))
    .to_iter_dataset()
  )
  rows = pipeline.pack_rows(
    docs, seq_len=seq_len, packing=packing, num_bins=3, seed=0, pad_id=TOK.pad_id
  )
  return list(rows)


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_packed_row_invariants(packing):
  L = 32
  for row in _packed_rows(packing, L):
    assert all(row[k].shape == (L,) and row[k].dtype == np.int32 for k in FIELDS)
    seg = row["segment_ids"]
    real = seg > 0
    n_real = real.sum()
    assert real[:n_real].all() and not real[n_real:].any(), "padding only at the end"
    assert np.array_equal(np.unique(seg[real]), np.arange(1, seg.max() + 1)), "ids 1..n"
    assert (np.diff(seg[real]) >= 0).all(), "segments contiguous"
    assert (row["tokens"][~real] == TOK.pad_id).all()
    assert (row["loss_mask"][~real] == 0).all() and (row["positions"][~real] == 0).all()
    for tokens, mask, positions in _segments(row):
      np.testing.assert_array_equal(positions, np.arange(len(tokens)))  # restart per segment
      assert (tokens[1:] != TOK.bos_id).all(), "bos only at a segment start: no leakage"
      assert (mask[tokens == TOK.bos_id] == 0).all()
      assert (mask[tokens == TOK.eos_id] == 1).all()


def test_first_fit_keeps_every_chunk_exactly_once():
  L = 32
  expected = collections.Counter()
  for r in _RECORDS:
    doc = pipeline.encode_record(r, TOK, prompt_loss=False)
    for i in range(0, len(doc["tokens"]), L):  # long documents become several segments
      expected[(tuple(doc["tokens"][i : i + L]), tuple(doc["loss_mask"][i : i + L]))] += 1
  got = collections.Counter(
    (tuple(t), tuple(m)) for row in _packed_rows("first_fit", L) for t, m, _ in _segments(row)
  )
  assert got == expected


def test_concat_keeps_every_token_in_order():
  L = 32
  docs = [pipeline.encode_record(r, TOK, prompt_loss=False) for r in _RECORDS]
  rows = _packed_rows("concat", L)
  real = [row["segment_ids"] > 0 for row in rows]
  for key in ("tokens", "loss_mask"):
    got = np.concatenate([row[key][m] for row, m in zip(rows, real)])
    np.testing.assert_array_equal(got, np.concatenate([d[key] for d in docs]))
  assert all(m.all() for m in real[:-1]), "concat pads only the last row"


def test_sft_prompt_masking_in_packed_rows():
  records = [{"prompt": "PPPP", "completion": "cc"}, {"prompt": "QQ", "completion": "ddd"}]
  for prompt_loss in (False, True):
    (row,) = _packed_rows("first_fit", 32, records, prompt_loss)
    text_ids = row["tokens"]
    prompt_pos = np.isin(text_ids, TOK.encode("PQ"))
    completion_pos = np.isin(text_ids, TOK.encode("cd")) | (text_ids == TOK.eos_id)
    assert (row["loss_mask"][prompt_pos] == int(prompt_loss)).all()
    assert (row["loss_mask"][completion_pos] == 1).all()
    assert (row["loss_mask"][text_ids == TOK.bos_id] == 0).all()


# ---------------------------------------------------------------- full iterator


def test_arithmetic_batches_shape_and_content():
  it = pipeline.make_train_iterator(_cfg(), TOK, batch_size=4, seq_len=128, seed=0)
  batch = next(it)
  assert set(batch) == {*FIELDS, "eos_tail"}
  assert not batch["eos_tail"].any()  # no EOS appended unless asked
  assert all(batch[k].shape == (4, 128) and batch[k].dtype == np.int32 for k in FIELDS)
  for row in (dict(zip(batch, vals)) for vals in zip(*batch.values())):
    for tokens, mask, _ in _segments(row):
      text = TOK.decode(tokens)
      if tokens[0] == TOK.bos_id and tokens[-1] == TOK.eos_id:  # a whole problem
        prompt, completion = text.split("\nA:")
        assert prompt.startswith("Q: ")
        assert mask.sum() == len(TOK.encode(completion)) + 1
        assert arithmetic.extract_answer(completion) is not None


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_deterministic_by_seed(packing):
  def batches(run_seed, **kw):
    cfg = _cfg(packing=packing, **kw)
    return _take(pipeline.make_train_iterator(cfg, TOK, batch_size=2, seq_len=64, seed=run_seed), 4)

  _assert_batches_equal(batches(0), batches(0))
  assert not np.array_equal(batches(0)[0]["tokens"], batches(1)[0]["tokens"])
  _assert_batches_equal(batches(5), batches(0, seed=5))  # data_cfg.seed overrides the run seed


@pytest.mark.parametrize("packing", pipeline.PACKINGS)
def test_state_save_restore_resumes_identically(packing):
  def make():
    return pipeline.make_train_iterator(
      _cfg(packing=packing), TOK, batch_size=3, seq_len=96, seed=7
    )

  it = make()
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON (grain's Orbax handler)
  expected = _take(it, 6)
  resumed = make()
  resumed.set_state(state)
  _assert_batches_equal(_take(resumed, 6), expected)


def test_orbax_checkpoint_of_iterator_and_train_state(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")

  def make():
    return pipeline.make_train_iterator(_cfg(), TOK, batch_size=2, seq_len=128, seed=1)

  it = make()
  _take(it, 3)
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(
      3,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(params), data_iter=grain.checkpoint.CheckpointSave(it)
      ),
    )
    mngr.wait_until_finished()
  expected = _take(it, 4)

  fresh = make()
  _take(fresh, 1)  # restore must override wherever the fresh iterator is
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(
      mngr.latest_step(),
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(params), data_iter=grain.checkpoint.CheckpointRestore(fresh)
      ),
    )
  np.testing.assert_array_equal(restored["state"]["w"], params["w"])
  _assert_batches_equal(_take(restored["data_iter"], 4), expected)


def _decoded_segments(it, n_batches):
  out = []
  for batch in _take(it, n_batches):
    for b in range(batch["tokens"].shape[0]):
      row = {k: v[b] for k, v in batch.items()}
      out += [TOK.decode(t) for t, _, _ in _segments(row)]
  return out


def _write_jsonl(path, objs):
  path.write_text("".join(json.dumps(o) + "\n" for o in objs))
  return str(path)


def test_jsonl_text_and_sft_sources(tmp_path):
  docs = [{"text": f"doc number {i}"} for i in range(6)]
  sft = [{"prompt": f"P{i}:", "completion": f" C{i}"} for i in range(4)]
  _write_jsonl(tmp_path / "a.jsonl", docs)
  _write_jsonl(tmp_path / "b.jsonl", sft)
  cfg = _cfg(
    source="jsonl", paths=f"{tmp_path}/a.jsonl, {tmp_path}/b*.jsonl", num_epochs=1, shuffle=False
  )
  it = pipeline.make_train_iterator(cfg, TOK, batch_size=1, seq_len=64, seed=0)
  got = []
  for batch in it:  # finite: num_epochs=1
    row = {k: v[0] for k, v in batch.items()}
    for tokens, mask, _ in _segments(row):
      text = TOK.decode(tokens)
      got.append(text)
      targets = text.split(":", 1)[1] if text.startswith("P") else text  # SFT: completion only
      assert mask.sum() == len(TOK.encode(targets)) + 1  # + eos
  assert sorted(got) == sorted(
    [d["text"] for d in docs] + [s["prompt"] + s["completion"] for s in sft]
  )


def test_text_files_source_and_host_sharding(tmp_path):
  for i in range(7):
    (tmp_path / f"d{i}.txt").write_text(f"file {i} body\nline two")
  cfg = _cfg(source="text", paths=str(tmp_path / "*.txt"), num_epochs=1)
  shards = [
    list(
      pipeline.make_train_iterator(
        cfg, TOK, batch_size=1, seq_len=128, seed=0, shard_index=s, shard_count=2
      )
    )
    for s in (0, 1)
  ]
  texts = [
    [TOK.decode(t) for b in batches for t, _, _ in _segments({k: v[0] for k, v in b.items()})]
    for batches in shards
  ]
  assert not set(texts[0]) & set(texts[1])
  assert sorted(texts[0] + texts[1]) == sorted(f"file {i} body\nline two" for i in range(7))


def test_array_record_source(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top

  path = tmp_path / "docs.array_record"
  writer = ArrayRecordWriter(str(path), "group_size:1")
  objs = [{"text": f"record {i}"} for i in range(5)] + [{"prompt": "Q:", "completion": " A"}]
  for o in objs:
    writer.write(json.dumps(o).encode())
  writer.close()
  cfg = _cfg(source="array_record", paths=str(path), num_epochs=1)
  it = pipeline.make_train_iterator(cfg, TOK, batch_size=1, seq_len=256, seed=0)
  got = [TOK.decode(t) for b in it for t, _, _ in _segments({k: v[0] for k, v in b.items()})]
  assert sorted(got) == sorted([f"record {i}" for i in range(5)] + ["Q: A"])


def test_jsonl_converted_to_array_record_shards_trains_on_the_same_batches(tmp_path):
  """Consecutive lines per shard, stored as they were: the converted corpus gives the JSONL
  source's batches, per host too; a bad line stops the conversion and leaves no shard."""
  from sbd_jax.data import to_array_record

  a = [{"body": f"doc {i} " + "x" * (i % 7)} for i in range(23)]
  b = [{"prompt": f"Q{i}:", "completion": f" A{i}"} for i in range(14)]
  _write_jsonl(tmp_path / "a.jsonl", a)
  (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(o) for o in b) + "\n\n")  # blank line
  jsonl = _cfg(source="jsonl", paths=f"{tmp_path}/*.jsonl", text_field="body", num_epochs=2)
  files = sources.expand_paths(jsonl.paths)
  shards = to_array_record.convert(files, str(tmp_path / "out" / "train"), 4, text_field="body")
  assert [p.rsplit("/", 1)[1] for p in shards] == [
    f"train-{i:05d}-of-00004.array_record" for i in range(4)
  ]
  assert sorted(os.listdir(tmp_path / "out")) == sorted(p.rsplit("/", 1)[1] for p in shards)
  converted = _cfg(**{**jsonl, "source": "array_record", "paths": f"{tmp_path}/out/train-*"})
  for host in range(2):
    kwargs = dict(batch_size=2, seq_len=24, seed=3, shard_index=host, shard_count=2)
    expected = list(pipeline.make_train_iterator(jsonl, TOK, **kwargs))
    assert len(expected) >= 8
    _assert_batches_equal(list(pipeline.make_train_iterator(converted, TOK, **kwargs)), expected)

  broken = tmp_path / "broken.jsonl"
  broken.write_text('{"body": "ok"}\n{"body": "ok"}\n{not json\n{"body": "ok"}\n')
  with pytest.raises(sources.DataError, match=f"{broken}:3: invalid JSON"):
    to_array_record.convert([str(broken)], str(tmp_path / "bad" / "train"), 2, text_field="body")
  assert os.listdir(tmp_path / "bad") == []  # no shard, finished or not
  bad = sources.BadRecords()
  skipped = to_array_record.convert(
    [str(broken)], str(tmp_path / "skip" / "train"), 2, text_field="body", bad=bad
  )
  assert bad.count == 1 and len(sources.make_source(
    _cfg(source="array_record", paths=",".join(skipped), text_field="body"), 0
  )) == 3  # fmt: skip


@pytest.mark.integration
def test_the_converter_cli_names_a_bad_line_in_one_line(tmp_path):
  broken = tmp_path / "broken.jsonl"
  broken.write_text('{"text": "ok"}\n{"text": 3}\n')
  out = subprocess.run(
    [sys.executable, "-m", "sbd_jax.data.to_array_record", f"--input={broken}"]
    + [f"--output={tmp_path}/train", "--num_shards=1"],
    capture_output=True,
    text=True,
  )
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1] == (
    f"error: {broken}:2: field 'text' is int, expected a string"
  )


_TFDS_BUILDER = """
import tensorflow_datasets as tfds

class TinyCorpus(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return self.dataset_info_from_configs(features=tfds.features.FeaturesDict({"body": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(4)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {"body": f"tfds doc {i}"}
"""


def test_tfds_source_offline(tmp_path, monkeypatch):
  """Prepares a tiny ArrayRecord TFDS dataset locally (no TensorFlow), reads it via the pipeline."""
  tfds = pytest.importorskip("tensorflow_datasets")
  import importlib.resources  # pylint: disable=g-import-not-at-top

  # tfds 4.9.10 needs the `importlib_resources` backport to *build* a dataset on Python >= 3.9;
  # the stdlib module provides the same API. Reading a prepared dataset does not need it.
  monkeypatch.setitem(sys.modules, "importlib_resources", importlib.resources)
  pkg = tmp_path / "tinypkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "tiny_corpus.py").write_text(_TFDS_BUILDER)
  monkeypatch.syspath_prepend(str(tmp_path))
  from tinypkg import tiny_corpus  # pylint: disable=g-import-not-at-top

  data_dir = str(tmp_path / "tfds")
  tiny_corpus.TinyCorpus(data_dir=data_dir, file_format="array_record").download_and_prepare()
  cfg = _cfg(
    source="tfds", tfds_name="tiny_corpus", tfds_data_dir=data_dir, text_field="body", num_epochs=1
  )
  it = pipeline.make_train_iterator(cfg, TOK, batch_size=1, seq_len=64, seed=0)
  got = [TOK.decode(t) for b in it for t, _, _ in _segments({k: v[0] for k, v in b.items()})]
  assert sorted(got) == [f"tfds doc {i}" for i in range(4)]

  with pytest.raises(ValueError, match="not prepared"):
    bad = _cfg(
      source="tfds", tfds_name="tiny_corpus", tfds_split="validation", tfds_data_dir=data_dir
    )
    pipeline.make_train_iterator(bad, TOK, batch_size=1, seq_len=8, seed=0)
  del tfds


# ---------------------------------------------------------------- errors


def _error(cfg, **kw):
  with pytest.raises(ValueError) as info:
    it = pipeline.make_train_iterator(cfg, TOK, **{"batch_size": 1, "seq_len": 16, "seed": 0, **kw})
    next(it)
  message = str(info.value)
  assert "\n" not in message, message
  return message


def test_clear_errors(tmp_path):
  assert "unknown data.source 'csv'" in _error(_cfg(source="csv"))
  assert "no files match" in _error(_cfg(source="jsonl", paths=str(tmp_path / "none*.jsonl")))
  bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"content": "no text"}])
  assert f"{bad}:2: missing field 'text'" in _error(_cfg(source="jsonl", paths=bad))
  (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
  assert "broken.jsonl:2: invalid JSON" in _error(
    _cfg(source="jsonl", paths=str(tmp_path / "broken.jsonl"))
  )
  (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
  assert "latin1.jsonl:2: not UTF-8 (byte 0xe9" in _error(
    _cfg(source="jsonl", paths=str(tmp_path / "latin1.jsonl"))
  )
  (tmp_path / "texts").mkdir()
  (tmp_path / "texts" / "bad.txt").write_bytes(b"caf\xe9 " * 8)  # read lazily, fails when read
  assert "bad.txt: not UTF-8 (byte 0xe9 at offset 3)" in _error(
    _cfg(source="text", paths=str(tmp_path / "texts" / "*.txt"))
  )
  assert "unknown data.packing" in _error(_cfg(packing="best"))
  assert "shard_index" in _error(_cfg(), shard_index=2, shard_count=2)
  assert "not prepared" in _error(
    _cfg(source="tfds", tfds_name="surely_missing_ds", tfds_data_dir=str(tmp_path))
  )


def _mixed_jsonl(tmp_path):
  """Six good records and three bad lines (invalid JSON, a missing field, non-UTF-8 bytes)."""
  good = [json.dumps({"text": f"good document {i}"}).encode() for i in range(6)]
  bad = [b"{not json", json.dumps({"content": "x"}).encode(), b'{"text": "caf\xe9"}']
  lines = good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:]
  (tmp_path / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  return str(tmp_path / "mixed.jsonl")


def test_bad_records_are_skipped_and_counted_when_asked(tmp_path):
  path = _mixed_jsonl(tmp_path)
  bad = sources.BadRecords()
  records = sources.read_jsonl([path], "text", bad)
  assert [r["text"] for r in records] == [f"good document {i}" for i in range(6)]
  assert bad.count == 3 and "mixed.jsonl:3: invalid JSON" in bad.examples[0]
  # Through the pipeline: only good documents reach the batches.
  cfg = _cfg(source="jsonl", paths=path, skip_bad_records=True, num_epochs=1, shuffle=False)
  counter = sources.BadRecords()
  it = pipeline.make_train_iterator(cfg, TOK, batch_size=1, seq_len=32, seed=0, bad_records=counter)
  texts = [TOK.decode([t for t in b["tokens"][0] if t < 256]) for b in it]
  assert sorted(texts) == [f"good document {i}" for i in range(6)] and counter.count == 3

  # Lazily read sources (here text files) skip when the bad file is read.
  (tmp_path / "texts").mkdir()
  for i in range(3):
    (tmp_path / "texts" / f"{i}.txt").write_text(f"text {i}")
  (tmp_path / "texts" / "3.txt").write_bytes(b"caf\xe9")
  cfg = _cfg(source="text", paths=str(tmp_path / "texts" / "*.txt"), skip_bad_records=True)
  cfg.update(num_epochs=1, shuffle=False)
  counter = sources.BadRecords()
  it = pipeline.make_train_iterator(cfg, TOK, batch_size=1, seq_len=10, seed=0, bad_records=counter)
  texts = [TOK.decode([t for t in b["tokens"][0] if t < 256]) for b in it]
  assert sorted(texts) == ["text 0", "text 1", "text 2"] and counter.count == 1
  assert counter.examples == [f"{tmp_path}/texts/3.txt: not UTF-8 (byte 0xe9 at offset 3)"]


@pytest.mark.integration
def test_worker_processes_match_in_process_and_restore():
  def make(num_workers):
    return pipeline.make_train_iterator(
      _cfg(num_workers=num_workers), TOK, batch_size=2, seq_len=96, seed=0
    )

  it, reference = make(1), make(0)
  try:
    _assert_batches_equal(_take(it, 3), _take(reference, 3))  # 1 worker: same stream as in process
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 2)
    resumed = make(1)
    try:
      resumed.set_state(state)
      _assert_batches_equal(_take(resumed, 2), expected)
    finally:
      resumed.close()
  finally:
    it.close()


def test_training_batches_mark_the_eos_tail_so_the_objective_masks_it():
  """With sbd.train_past_eos the pipeline appends EOS tokens to each document; the batch must
  still say which (`eos_tail`), or the objective leaves them clean in x̂: the block would then
  see EOS tokens that decoding never shows there."""
  import jax
  import jax.numpy as jnp

  from sbd_jax import config as config_lib
  from sbd_jax.sbd import objective

  c = config_lib.base_config()
  tail = 3
  batch = next(
    pipeline.make_train_iterator(c.data, TOK, batch_size=2, seq_len=512, seed=0, eos_tail=tail)
  )
  assert set(batch) == {*FIELDS, "eos_tail"}
  for i in range(2):
    for tokens, mask, _ in _segments({k: v[i] for k, v in batch.items()}):
      own_eos = int(np.flatnonzero(mask)[-1])  # the document's own EOS: its last target
      assert tokens[own_eos] == TOK.eos_id and len(tokens) == own_eos + 1 + tail
    np.testing.assert_array_equal(
      batch["eos_tail"][i] > 0,
      (batch["tokens"][i] == TOK.eos_id)
      & (batch["loss_mask"][i] == 0)
      & (batch["segment_ids"][i] > 0),
    )
  cfg = objective.ObjectiveConfig(
    mask_id=TOK.mask_id, k_min=4, k_max=4, full_block_prob=1.0, block_anchor="completion"
  )
  sbd, _ = objective.make_batch(
    {k: jnp.asarray(v) for k, v in batch.items()}, jax.random.key(0), cfg
  )
  noisy = np.asarray(sbd.inputs[:, batch["tokens"].shape[1] :])
  # Every block is masked whole, so the tail tokens inside their EOS's block are masks too.
  in_eos_block = np.asarray(sbd.matp_weights) > 0
  tail_masked = (batch["eos_tail"] > 0) & in_eos_block
  assert tail_masked.any() and (noisy[tail_masked] == TOK.mask_id).all()


def test_the_global_batch_does_not_depend_on_which_process_holds_which_slice():
  """A batch of 4 row slices read by one process (all 4) equals two processes' halves stacked,
  and a process holding a slice twice over (replicas) reads it alike; the iterator resumes
  from its state."""

  def rows(slices, n=3):
    ds = pipeline.make_slices_dataset(
      _cfg(), TOK, slice_rows=2, slices=slices, slice_count=4, seq_len=64, seed=7
    )
    return _take(iter(ds), n)

  whole, first, second = rows([0, 1, 2, 3]), rows([0, 1]), rows([2, 3])
  halves = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(first, second)]
  _assert_batches_equal(whole, halves)
  assert whole[0]["tokens"].shape == (8, 64)
  assert not np.array_equal(whole[0]["tokens"][:2], whole[0]["tokens"][2:4])  # slices differ
  _assert_batches_equal(rows([2]), [{k: v[4:6] for k, v in b.items()} for b in whole])
  it = iter(pipeline.make_slices_dataset(
    _cfg(), TOK, slice_rows=2, slices=[1, 3], slice_count=4, seq_len=64, seed=7
  ))  # fmt: skip
  next(it)
  state = it.get_state()
  expected = _take(it, 2)
  it.set_state(state)
  _assert_batches_equal(_take(it, 2), expected)
