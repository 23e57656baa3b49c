"""TensorBoard event files (read back with TensorBoard's own reader) and the optional W&B hook."""

import importlib.machinery
import json
import os
import sys
import types

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from sbd_jax import config
from sbd_jax.evals import results as results_lib
from sbd_jax.training import dashboards, trainer

TRAIN_TAGS = ("loss", "ntp_loss", "matp_loss", "lr", "grad_norm", "tokens_per_s")


def read_events(workdir):
  acc = event_accumulator.EventAccumulator(os.path.join(workdir, dashboards.TENSORBOARD_DIR))
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_evaluation_scalars_are_named_per_decoding(tmp_path):
  """What `report_after_training` writes after the main job, read back by TensorBoard."""
  summary = {
    "decodings": [
      {"decoding": "ntp", "accuracy": 0.75, "nfe_speedup": 1.0},
      {"decoding": "sbd eb_entropy γ=0.1", "accuracy": 0.5, "nfe_speedup": 2.5},
      {"decoding": "sbd eb_confidence γ=0.35", "accuracy": 0.25, "nfe_speedup": 3.25},
    ],
  }
  board = dashboards.Dashboards(str(tmp_path))
  board.scalars(700, results_lib.dashboard_scalars(summary), prefix="eval")
  board.close()
  events = read_events(tmp_path)
  assert events == {
    "eval/ntp_accuracy": [(700, 0.75)],
    "eval/sbd_eb_entropy_gamma0.1_accuracy": [(700, 0.5)],
    "eval/sbd_eb_entropy_gamma0.1_nfe_speedup": [(700, 2.5)],
    "eval/sbd_eb_confidence_gamma0.35_accuracy": [(700, 0.25)],
    "eval/sbd_eb_confidence_gamma0.35_nfe_speedup": [(700, 3.25)],
  }


@pytest.fixture
def fake_wandb(monkeypatch):
  """A stand-in `wandb` module recording what it is given."""
  calls = {"init": [], "log": [], "finish": 0}

  class Run:
    def log(self, values, step):
      calls["log"].append((step, dict(values)))

    def finish(self):
      calls["finish"] += 1

  def init(**kwargs):
    calls["init"].append(kwargs)
    return Run()

  module = types.ModuleType("wandb")
  module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
  module.init = init
  monkeypatch.setitem(sys.modules, "wandb", module)
  return calls


@pytest.mark.integration  # a training run into both dashboards
def test_training_scalars_reach_tensorboard_and_wandb_as_logged(
  tmp_path, tiny_train_config, fake_wandb
):
  c = tiny_train_config(steps=3)
  c.train.wandb_project = "sbd-tests"
  trainer.train(c, str(tmp_path))
  c.train.steps = 5  # resumed: a second event file and the same W&B run
  trainer.train(c, str(tmp_path))

  events, records = read_events(tmp_path), read_metrics(tmp_path)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  assert {f"train/{t}" for t in TRAIN_TAGS} <= set(events)
  assert "train/mfu" not in events  # NaN on a CPU (unknown peak): left out, not written as NaN
  for tag in TRAIN_TAGS:
    logged = [(r["step"], r[tag]) for r in records if r[tag] is not None]
    assert [s for s, _ in events[f"train/{tag}"]] == [s for s, _ in logged]
    np.testing.assert_allclose([v for _, v in events[f"train/{tag}"]], [v for _, v in logged])
  assert len(events["train/loss"]) == 5

  first, second = fake_wandb["init"]
  assert first["project"] == "sbd-tests" and first["id"] == second["id"]
  assert first["config"]["train"]["wandb_project"] == "sbd-tests"
  assert [step for step, _ in fake_wandb["log"]] == [1, 2, 3, 4, 5]
  for (step, values), record in zip(fake_wandb["log"], records):
    assert step == record["step"] and values["train/loss"] == pytest.approx(record["loss"])
  assert fake_wandb["finish"] == 2


def test_wandb_configured_but_missing_is_a_config_error(monkeypatch, tiny_train_config):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
  c = tiny_train_config()
  c.train.wandb_project = "sbd-tests"
  with pytest.raises(config.ConfigError, match="needs wandb: pip install wandb"):
    config.validate(c)


def test_a_bucket_tensorboard_cannot_open_is_a_warning_not_a_crash(caplog, monkeypatch, tmp_path):
  """A remote workdir whose filesystem TensorBoard lacks (gs:// without gcsfs; here a scheme
  no library knows) leaves the run going without events; its W&B id does not depend on the
  directory a host starts in (a local path's does not either: it is made absolute)."""
  board = dashboards.Dashboards("nosuchfs://bucket/run")
  board.scalars(1, {"loss": 1.0}, prefix="train")  # a no-op
  board.close()
  assert "no TensorBoard events in nosuchfs://bucket/run" in caplog.text
  ids = []
  for cwd in (tmp_path, tmp_path.parent):
    monkeypatch.chdir(cwd)
    ids.append(dashboards.wandb_run_id("gs://b/run"))
  assert ids[0] == ids[1] != dashboards.wandb_run_id("gs://b/other")
