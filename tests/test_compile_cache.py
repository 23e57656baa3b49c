"""The persistent compilation cache (`config.compile_cache`): a second launch loads the train step
and the decode from the cache the first one filled, and trains the same losses."""

import json

import jax
import pytest

from sbd_jax import compile_cache

pytestmark = pytest.mark.integration  # CLI launches that reuse a compilation cache

HITS, MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class CacheEvents:
  """Counts JAX's persistent-cache hits and misses while `recording`."""

  def __init__(self):
    self.recording, self.counts = False, {HITS: 0, MISSES: 0}
    jax.monitoring.register_event_listener(self._on_event)

  def _on_event(self, event, **kwargs):
    if self.recording and event in self.counts:
      self.counts[event] += 1

  def during(self, fn):
    self.counts = {HITS: 0, MISSES: 0}
    self.recording = True
    try:
      return fn()
    finally:
      self.recording = False


@pytest.fixture
def restore_cache_dir():
  """The suite shares one cache (conftest.py); a test that moves it puts it back."""
  before = jax.config.jax_compilation_cache_dir
  yield
  compile_cache.enable(before)


def test_directory_of_each_setting(tmp_path):
  assert compile_cache.directory("", str(tmp_path)) is None
  assert compile_cache.directory("workdir", str(tmp_path)) == str(tmp_path / "compile_cache")
  assert compile_cache.directory("gs://bucket/cache", None) == "gs://bucket/cache"
  assert compile_cache.directory(str(tmp_path / "c"), "gs://b/run") == str(tmp_path / "c")
  with pytest.raises(ValueError, match="needs a workdir"):
    compile_cache.directory("workdir", None)


def losses(workdir):
  return [json.loads(line)["loss"] for line in open(workdir / "metrics.jsonl") if '"loss"' in line]


def test_a_second_launch_loads_the_train_step_and_decode_from_the_cache(
  tmp_path, tiny_train_config, restore_cache_dir
):
  from sbd_jax.run import compare
  from sbd_jax.training import trainer

  events = CacheEvents()
  first, second = tmp_path / "first", tmp_path / "second"
  c = tiny_train_config(steps=3)
  c.sbd.ntp_steps = 1  # both phases' steps
  c.compile_cache = "workdir"
  events.during(lambda: trainer.train(c, str(first)))
  cache = first / "compile_cache"
  assert events.counts[MISSES] >= 2 and events.counts[HITS] == 0, events.counts
  events.during(lambda: compare.sample_workdir(str(first), ["Q: 1"], max_new_tokens=4))
  assert events.counts[MISSES] >= 1, events.counts
  entries = set(p.name for p in cache.iterdir())

  c.compile_cache = str(cache)  # another run of the same config, on the first run's cache
  events.during(lambda: trainer.train(c, str(second)))
  assert events.counts[HITS] >= 2 and events.counts[MISSES] == 0, events.counts
  assert losses(second) == losses(first)
  events.during(lambda: compare.sample_workdir(str(second), ["Q: 1"], max_new_tokens=4))
  assert events.counts[HITS] >= 1 and events.counts[MISSES] == 0, events.counts
  assert set(p.name for p in cache.iterdir()) == entries  # nothing compiled anew
  assert not (second / "compile_cache").exists()
