"""Held-out evaluation while training (`train.eval_every`): which documents are held out, the
losses against independent forwards, and a run that logs, draws and resumes with them."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx
from tensorboard.backend.event_processing import event_accumulator

from sbd_jax import config as config_lib
from sbd_jax import sharding
from sbd_jax.data import heldout as heldout_data
from sbd_jax.data import mixture, pipeline
from sbd_jax.data.errors import DataError
from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.sbd import objective
from sbd_jax.training import heldout, optim
from sbd_jax.training.state import make_state_spec

TOK = ByteTokenizer()


def jsonl(path, n, prefix="doc"):
  path.write_text("".join(json.dumps({"text": f"{prefix} {i}"}) + "\n" for i in range(n)))
  return str(path)


def texts(docs):
  return {docs[i]["text"] for i in range(len(docs))}


def test_the_held_out_documents_are_never_trained_on(tmp_path):
  cfg = pipeline.default_data_config()
  cfg.update(source="jsonl", paths=jsonl(tmp_path / "a.jsonl", 30), holdout=5)
  train = texts(pipeline._source(cfg, 0, None, "train"))
  held = texts(pipeline._source(cfg, 0, None, "heldout"))
  assert held == {f"doc {i}" for i in range(25, 30)}
  assert train == {f"doc {i}" for i in range(25)}
  # Every shard of the training stream reads only training documents.
  for shard in range(2):
    docs = mixture.documents(pipeline._source(cfg, 0, None), cfg, 0, shard, 2)
    assert {docs[i]["text"] for i in range(60)} <= train

  # A mixture holds out per source; a source may set its own count.
  mix = pipeline.default_data_config()
  mix.mixture = (
    dict(weight=1.0, source="jsonl", paths=jsonl(tmp_path / "b.jsonl", 12, "b"), holdout=2),
    dict(weight=1.0, source="jsonl", paths=jsonl(tmp_path / "c.jsonl", 9, "c")),
  )
  mix.holdout = 3
  parts = {p: pipeline._source(mix, 0, None, p) for p in ("train", "heldout")}
  assert [len(d) for d, _ in parts["train"]] == [10, 6]
  assert [texts(d) for d, _ in parts["heldout"]] == [{"b 10", "b 11"}, {"c 6", "c 7", "c 8"}]


def test_the_held_out_data_of_a_run(tmp_path):
  c = config_lib.base_config()
  c.train.eval_every = 10
  assert heldout_data.eval_data_config(c)[1] == "eval"  # the arithmetic task's eval split
  c.data.update(source="jsonl", paths=jsonl(tmp_path / "a.jsonl", 10))
  with pytest.raises(DataError, match="needs held-out data: set eval.paths"):
    heldout_data.eval_data_config(c)
  c.data.holdout = 4
  assert heldout_data.eval_data_config(c)[1] == "heldout"
  c.eval.paths = jsonl(tmp_path / "held.jsonl", 3, "held")
  data, part = heldout_data.eval_data_config(c)
  assert (part, data.paths, data.holdout, data.source) == ("all", c.eval.paths, 0, "jsonl")
  assert texts(pipeline._source(data, 0, None, part)) == {"held 0", "held 1", "held 2"}


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("train.eval_every", -1, "train.eval_every must be >= 0, got -1"),
    ("data.holdout", -2, "data.holdout must be >= 0, got -2"),
    ("eval.batches", 0, "eval.batches must be >= 1, got 0"),
    ("eval.mask_rates", (0.5, 1.5), "eval.mask_rates must be rates in (0, 1], got (0.5, 1.5)"),
    ("eval.block_size", 32, "eval.block_size 32 is outside the trained block sizes [2, 16]"),
    ("eval.decode_problems", 4, "eval.decode_problems decodes the built-in task's problems"),
    ("data.paths", "x.jsonl", "train.eval_every needs held-out data"),
  ],
)
def test_bad_held_out_settings_are_one_line(field, value, message):
  c = config_lib.base_config()
  c.train.eval_every = 5
  if field in ("eval.decode_problems", "data.paths"):
    c.data.source = "jsonl"
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    config_lib.validate(c)


def test_too_large_a_holdout_is_one_line(tmp_path):
  cfg = pipeline.default_data_config()
  cfg.update(source="jsonl", paths=jsonl(tmp_path / "a.jsonl", 4), holdout=4)
  with pytest.raises(DataError, match=r"data.holdout=4 leaves no training documents in .*a.jsonl"):
    pipeline._source(cfg, 0, None)


def test_the_losses_are_those_of_independent_forwards(tiny_train_config):
  """NTP loss: the clean half of the evaluation's 2L forward against a causal L-token forward
  (the NTP objective). MATP at rate 1: the training objective set to mask whole blocks of the
  same size (full_block_prob = 1, k fixed) on the same batch."""
  c = tiny_train_config()
  c.sbd.update(k_min=2, k_max=8)
  c.sample.block_size = 4
  mesh = sharding.mesh_from_config(c.mesh, jax.devices()[:1])  # exactness: one device
  model_cfg = config_lib.to_model_config(c)
  obj_cfg = config_lib.to_objective_config(c, TOK.mask_id)
  tx, _ = optim.make_optimizer(c.optim, c.train.steps)
  spec = make_state_spec(model_cfg, tx, mesh, 0)
  state = spec.init()
  local = next(
    iter(
      pipeline.make_train_dataset(
        c.data, TOK, batch_size=c.train.batch_size, seq_len=c.train.seq_len, seed=0,
        eos_tail=config_lib.eos_tail_length(c),
      )
    )
  )  # fmt: skip
  batch = {k: jax.numpy.asarray(v) for k, v in local.items()}
  rates = (0.5, 1.0)
  step = heldout.make_eval_step(spec, obj_cfg, mesh, rates, 4, seed=3)
  got = {k: float(s / n) for k, (s, n) in jax.device_get(step(state, batch)).items()}
  assert sorted(got) == sorted(heldout.metric_names("sbd", rates))

  net = nnx.merge(spec.graphdef, state).model

  def metrics_of(cfg):
    return nnx.jit(lambda m, b: objective.loss_fn(m, b, jax.random.key(0), cfg)[1])(net, batch)

  ntp_metrics = metrics_of(dataclasses.replace(obj_cfg, mode="ntp"))
  np.testing.assert_allclose(got["ntp_loss"], float(ntp_metrics["ntp_loss"]), rtol=2e-5)
  sbd_metrics = metrics_of(dataclasses.replace(obj_cfg, k_min=4, k_max=4, full_block_prob=1.0))
  assert float(sbd_metrics["block_size"]) == 4
  np.testing.assert_allclose(
    got["matp_loss_mask1"], float(sbd_metrics["matp_loss_per_masked"]), rtol=2e-5
  )
  assert abs(got["matp_loss_mask0.5"] - got["matp_loss_mask1"]) > 1e-4  # another input
  # The same masks every time.
  again = {k: float(s / n) for k, (s, n) in jax.device_get(step(state, batch)).items()}
  assert again == got


@pytest.mark.integration  # two training runs
def test_a_run_logs_draws_and_resumes_its_held_out_losses(tmp_path, tiny_train_config):
  from sbd_jax.training import dashboards, metrics_plot, trainer

  workdir = str(tmp_path / "run")
  c = tiny_train_config(steps=4)
  c.train.eval_every = 2
  c.eval.update(batches=2, mask_rates=(0.5, 1.0))
  c.sample.block_size = 4
  c.checkpoint.every_steps = 2
  trainer.train(c, workdir)
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  held = [r for r in records if "heldout/ntp_loss" in r]
  assert [r["step"] for r in held] == [2, 4]
  assert set(held[0]) == {"step", "heldout/ntp_loss", "heldout/matp_loss_mask0.5",
                          "heldout/matp_loss_mask1"}  # fmt: skip
  assert all(np.isfinite(v) for r in held for v in r.values())
  assert held[1]["heldout/ntp_loss"] < held[0]["heldout/ntp_loss"]  # it trains
  # In TensorBoard under heldout/, and drawn by plot_metrics in a panel of its own.
  events = event_accumulator.EventAccumulator(f"{workdir}/{dashboards.TENSORBOARD_DIR}")
  tags = set(events.Reload().Tags()["scalars"])
  assert {"heldout/ntp_loss", "heldout/matp_loss_mask1", "train/loss"} <= tags
  merged = metrics_plot.read_metrics(workdir)
  assert [r["step"] for r in merged] == [1, 2, 3, 4]
  assert "loss" in merged[1] and "heldout/ntp_loss" in merged[1]
  out = metrics_plot.plot(merged, str(tmp_path / "m.png"))
  assert open(out, "rb").read(4) == b"\x89PNG"

  # A resume may change how often and what it evaluates, not which documents are held out.
  c.train.steps = 6
  c.data.holdout = 5
  with pytest.raises(config_lib.ConfigError, match="data.holdout"):
    trainer.train(c, workdir)
  c.data.holdout = 0
  c.train.eval_every, c.eval.mask_rates = 3, (1.0,)
  trainer.train(c, workdir)
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in records if "heldout/ntp_loss" in r] == [2, 4, 6]
  assert "heldout/matp_loss_mask0.5" not in records[-1]


@pytest.mark.integration  # decodes with three settings at each evaluation
def test_a_held_out_decode_reports_accuracy_and_forwards(tmp_path, tiny_train_config):
  from sbd_jax.evals import while_training
  from sbd_jax.training import trainer

  c = tiny_train_config(steps=2)
  c.train.eval_every = 2
  c.eval.update(batches=1, decode_problems=3)
  c.sample.update(block_size=4, gammas=(0.35,), max_new_tokens=8)
  trainer.train(c, str(tmp_path), decode_eval=while_training.decoder)
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  (record,) = [r for r in records if "heldout/ntp_loss" in r]
  assert record["step"] == 2
  plain, verified = "sbd_eb_entropy_gamma0.35", "sbd_verified"
  for name in ("ntp", plain, verified):
    assert 0 <= record[f"heldout/{name}_accuracy"] <= 1
  # Verified SBD answers as NTP does, problem by problem: the same accuracy.
  assert record[f"heldout/{verified}_accuracy"] == record["heldout/ntp_accuracy"]
  assert record[f"heldout/{plain}_nfe_speedup"] >= 1.0
