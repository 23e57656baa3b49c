"""Workdir paths: URLs (gs://...) are kept as they are, local paths made absolute; the
metrics log appends locally and rewrites remote files (which cannot be appended to)."""

import json

import ml_collections

from sbd_jax import paths
from sbd_jax.run import workdir as workdir_lib
from sbd_jax.training import metrics


def test_urls_stay_urls_and_local_paths_become_absolute(tmp_path, monkeypatch):
  run = paths.resolve("gs://bucket/runs/llama8b")
  assert str(run / "checkpoints") == "gs://bucket/runs/llama8b/checkpoints"
  assert paths.is_remote("gs://bucket/x") and not paths.is_remote("/tmp/x")
  monkeypatch.chdir(tmp_path)
  assert str(paths.resolve("run")) == str(tmp_path / "run")


def test_config_round_trip_through_a_relative_workdir(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  workdir_lib.write_config("nested/run", ml_collections.ConfigDict({"a": 1, "b": {"c": "x"}}))
  assert (tmp_path / "nested/run/config.json").is_file()
  assert workdir_lib.read_config("nested/run").to_dict() == {"a": 1, "b": {"c": "x"}}


def test_remote_metrics_logs_are_rewritten_whole_and_resumed(tmp_path, monkeypatch):
  monkeypatch.setattr(paths, "is_remote", lambda path: True)  # a local file plays the bucket
  log = tmp_path / "metrics.jsonl"
  log.write_text(json.dumps({"step": 1}) + "\n")  # from before a restart
  appender = metrics._JsonlAppender(str(log))
  for step in (2, 3):
    appender.append(json.dumps({"step": step}))
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == list(range(1, step + 1))
  appender.close()
