"""Parquet shards with the real datasets' field layouts (`data.parquet`, `data.fields`): read by
row group, mapped to records, and trained on exactly as the same records in JSONL."""

import json

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from sbd_jax.data import pipeline, sources  # noqa: E402
from sbd_jax.data.errors import DataError  # noqa: E402
from sbd_jax.data.fields import FieldMap, parse_record  # noqa: E402
from sbd_jax.data.tokenizer import ByteTokenizer  # noqa: E402

TOK = ByteTokenizer()

# OpenMathReasoning's layout (problem / generated_solution), with a column training ignores.
MATH = [
  {"problem": f"What is {i} + {i}?", "generated_solution": f"It is {2 * i}.", "source": "x"}
  for i in range(17)
]
# ShareGPT's: conversations of {from, value} with human / gpt roles.
SHAREGPT = [
  {"conversations": [{"from": "human", "value": f"hi {i}"}, {"from": "gpt", "value": f"yo {i}"}]}
  for i in range(5)
]


def write_parquet(path, rows, row_group_size):
  pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
  return str(path)


def data_cfg(**overrides):
  cfg = pipeline.default_data_config()
  cfg.update(overrides)
  return cfg


def math_cfg(paths, **kw):
  cfg = data_cfg(source="parquet", paths=paths, **kw)
  cfg.fields.update(prompt="problem", completion="generated_solution")
  return cfg


def test_rows_in_file_order_read_a_row_group_at_a_time(tmp_path, monkeypatch):
  first = write_parquet(tmp_path / "a.parquet", MATH[:10], row_group_size=4)
  write_parquet(tmp_path / "b.parquet", MATH[10:], row_group_size=3)
  read = []
  real = pq.ParquetFile.read_row_group
  monkeypatch.setattr(
    pq.ParquetFile, "read_row_group", lambda self, g, *a, **k: read.append(g) or real(self, g)
  )
  monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("a whole file read"))
  source = sources.make_source(math_cfg(f"{tmp_path}/*.parquet"), seed=0)
  assert len(source) == 17
  want = [{"prompt": r["problem"], "completion": r["generated_solution"]} for r in MATH]
  assert [source[i] for i in range(17)] == want
  assert len(read) == 3 + 3  # a.parquet: groups of 4, 4, 2; b.parquet: 3, 3, 1
  assert source[13] == want[13] and first.endswith("a.parquet")
  with pytest.raises(IndexError):
    source[17]


def test_sharegpt_conversations_map_to_messages_with_the_templates_roles(tmp_path):
  path = write_parquet(tmp_path / "chat.parquet", SHAREGPT, row_group_size=2)
  cfg = data_cfg(source="parquet", paths=path)
  cfg.fields.update(messages="conversations", role="from", content="value")
  source = sources.make_source(cfg, seed=0)
  assert source[3] == {
    "messages": [{"role": "user", "content": "hi 3"}, {"role": "assistant", "content": "yo 3"}]
  }


def test_a_row_without_its_mapped_fields_names_file_and_row_or_is_counted(tmp_path):
  rows = MATH[:3] + [{"problem": "no solution", "generated_solution": None, "source": "x"}]
  path = write_parquet(tmp_path / "bad.parquet", rows, row_group_size=2)
  source = sources.make_source(math_cfg(path), seed=0)
  with pytest.raises(DataError, match=r"bad\.parquet row 3: field 'generated_solution' is "):
    source[3]
  bad = sources.BadRecords()
  skipping = sources.make_source(math_cfg(path, skip_bad_records=True), seed=0, bad=bad)
  assert skipping[3] is None and skipping[1] == source[1] and bad.count == 1
  with pytest.raises(DataError, match="not a readable parquet file"):
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    sources.make_source(math_cfg(str(tmp_path / "junk.parquet")), seed=0)


def test_parquet_trains_on_the_batches_of_the_same_records_in_jsonl(tmp_path):
  """The same records as JSONL (prompt / completion) and as two parquet files with Hub field
  names give identical batches, per host too."""
  (tmp_path / "same.jsonl").write_text(
    "".join(
      json.dumps({"prompt": r["problem"], "completion": r["generated_solution"]}) + "\n"
      for r in MATH
    )
  )
  write_parquet(tmp_path / "p0.parquet", MATH[:9], row_group_size=4)
  write_parquet(tmp_path / "p1.parquet", MATH[9:], row_group_size=5)
  jsonl = data_cfg(source="jsonl", paths=str(tmp_path / "same.jsonl"), num_epochs=2)
  parquet = math_cfg(f"{tmp_path}/p*.parquet", num_epochs=2)
  for host in range(2):
    kw = dict(batch_size=2, seq_len=32, seed=5, shard_index=host, shard_count=2)
    want = list(pipeline.make_train_iterator(jsonl, TOK, **kw))
    got = list(pipeline.make_train_iterator(parquet, TOK, **kw))
    assert len(want) >= 4 and len(got) == len(want)
    for a, b in zip(got, want):
      for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize(
  "fields, record, want",
  [
    ({}, {"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": "c"}),
    ({"prompt": "input", "completion": "output"}, {"input": "i", "output": "o"},
     {"prompt": "i", "completion": "o"}),
    ({}, {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
     {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}),
    ({"roles": "bot:assistant"}, {"messages": [{"role": "bot", "content": "a"}]},
     {"messages": [{"role": "assistant", "content": "a"}]}),
  ],
)  # fmt: skip
def test_field_maps_of_the_common_layouts(fields, record, want):
  cfg = data_cfg()
  cfg.fields.update(fields)
  assert parse_record(record, FieldMap.of(cfg), "r") == want


def test_a_config_saved_before_field_maps_reads_with_the_defaults():
  saved = data_cfg().to_dict()
  del saved["fields"]
  import ml_collections

  assert FieldMap.of(ml_collections.ConfigDict(saved)) == FieldMap()
  with pytest.raises(DataError, match="expected 'from:to' pairs"):
    cfg = data_cfg()
    cfg.fields.roles = "gpt"
    FieldMap.of(cfg)


def test_a_run_started_before_field_maps_resumes_unless_they_change(tmp_path):
  """A workdir whose config.json predates `data.fields` resumes with the fields at their
  defaults; a field map that reads its data differently is a conflict."""
  from sbd_jax import config
  from sbd_jax.run import workdir

  saved = config.base_config().to_dict()
  del saved["data"]["fields"]
  (tmp_path / "config.json").write_text(json.dumps(saved, default=list))
  assert workdir.resume_conflicts(str(tmp_path), config.base_config()) == []
  changed = config.base_config()
  changed.data.fields.prompt = "problem"
  assert workdir.resume_conflicts(str(tmp_path), changed) == [
    "data.fields.prompt: None -> 'problem'"
  ]
