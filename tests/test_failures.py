"""Failures inside a training run, in process: NaNs injected at chosen steps through the loss
(a stop that never saves the bad state, or train.skip_nonfinite_steps), bad data records
(data.skip_bad_records), and a workdir resumed with another run's config."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from sbd_jax import config, sharding
from sbd_jax.run import checkpointing
from sbd_jax.sbd import objective
from sbd_jax.training import optim, state, trainer

BAD_STEPS = (2, 4)  # 0-based step indices whose loss is made NaN


@pytest.fixture
def nan_at_steps(monkeypatch):
  """Makes the loss NaN at `BAD_STEPS`: the step's rng is fold_in(key(seed), step) (see
  `step.make_train_step`), so the poisoned steps are recognised by their rng."""
  real_loss_fn = objective.loss_fn

  def poisoned(model, batch, rng, cfg):
    loss, metrics = real_loss_fn(model, batch, rng, cfg)
    data = jax.random.key_data(rng)
    bad = jnp.zeros((), bool)
    for s in BAD_STEPS:
      bad |= jnp.all(data == jax.random.key_data(jax.random.fold_in(jax.random.key(0), s)))
    scale = jnp.where(bad, jnp.nan, 1.0)
    metrics = dict(metrics, ntp_loss=metrics["ntp_loss"] * scale)
    return loss * scale, metrics

  monkeypatch.setattr(objective, "loss_fn", poisoned)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def saved_params(workdir, step, abstract):
  """The model leaves of checkpoint `step` (the state item only; the data cursor is not read)."""
  manager = checkpointing.make_manager(str(workdir), 1, 10, False)
  target = nnx.to_pure_dict(abstract)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  manager.close()
  return jax.tree.leaves(restored["state"]["model"])


@pytest.mark.integration  # a training run
def test_nonfinite_step_stops_before_saving_it(tmp_path, nan_at_steps, tiny_train_config):
  c = tiny_train_config()
  c.checkpoint.every_steps = 1
  with pytest.raises(
    FloatingPointError, match=r"non-finite ntp_loss = nan, grad_norm = nan at step 3;"
  ):
    trainer.train(c, str(tmp_path))
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert saved == [1, 2]  # the state after the NaN step (3) is never written
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_skipped_updates_leave_the_state_untouched_and_are_logged(
  tmp_path, nan_at_steps, tiny_train_config
):
  c = tiny_train_config()
  c.train.skip_nonfinite_steps = 2
  c.checkpoint.every_steps = 1
  metrics = trainer.train(c, str(tmp_path))
  assert metrics["skipped_updates"] == 2 and np.isfinite(metrics["loss"])
  records = read_metrics(tmp_path)
  # The NaN steps are left out of the metrics; every logged value is finite.
  assert [r["step"] for r in records] == [1, 2, 4, 6]
  assert [r["skipped_updates"] for r in records] == [0, 0, 1, 2]
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in records)
  # A skipped update changes nothing: the state after step 3 is the state after step 2 ...
  spec = state.make_state_spec(
    config.to_model_config(c),
    optim.make_optimizer(c.optim, c.train.steps, 2)[0],
    sharding.make_mesh(c.mesh.shape),
    c.train.seed,
  )
  before, after, next_ = (saved_params(tmp_path, s, spec.abstract) for s in (2, 3, 4))
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)
  # ... and a finite step after it trains again.
  assert any(not np.array_equal(a, b) for a, b in zip(after, next_))


def test_more_nonfinite_steps_than_allowed_stop_the_run(tmp_path, nan_at_steps, tiny_train_config):
  c = tiny_train_config()
  c.train.skip_nonfinite_steps = 1
  c.checkpoint.every_steps = 1
  with pytest.raises(FloatingPointError, match=r"at step 5 after 1 skipped updates"):
    trainer.train(c, str(tmp_path))
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert max(saved) == 4


@pytest.mark.integration  # a training run
def test_skipped_bad_records_are_counted_in_the_metrics(tmp_path, tiny_train_config):
  good = [json.dumps({"prompt": f"copy {i}:", "completion": f" {i}."}) for i in range(40)]
  lines = good[:10] + ["{oops", json.dumps({"prompt": 1, "completion": "x"})] + good[10:]
  (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
  c = tiny_train_config(steps=2)
  c.data.update(source="jsonl", paths=str(tmp_path / "data.jsonl"), skip_bad_records=True)
  trainer.train(c, str(tmp_path / "run"))
  records = read_metrics(tmp_path / "run")
  assert [r["skipped_records"] for r in records] == [2, 2]


def test_a_train_state_that_cannot_fit_fails_before_allocating(tmp_path, tiny_train_config):
  c = tiny_train_config()
  # ~1.2e11 parameters: with AdamW about 170 GiB per device on the 8 test devices.
  c.model.update(num_layers=8, embed_dim=32768, num_heads=256, num_kv_heads=8, head_dim=128)
  c.model.mlp_dim = 131072
  with pytest.raises(config.ConfigError, match=r"the train state .* needs \d+\.\d GiB per device"):
    trainer.train(c, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")
  abstract = state.make_state_spec(
    config.to_model_config(c),
    optim.make_optimizer(c.optim, 1)[0],
    sharding.make_mesh(c.mesh.shape),
    0,
  ).abstract
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract["model"], nnx.Param)))
  # fp32 parameters and two AdamW moments, split over the 8 devices
  assert state.state_bytes_per_device(abstract) == pytest.approx(12 * n_params / 8, rel=0.01)


def test_a_workdir_started_with_another_config_is_refused_untouched(tmp_path, tiny_train_config):
  c = tiny_train_config(steps=2)
  trainer.train(c, str(tmp_path))
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

  other = tiny_train_config(steps=4)
  other.sbd.full_block_prob = 0.5
  other.optim.lr = 1e-3
  with pytest.raises(
    config.ConfigError, match=r"optim\.lr: 0\.003 -> 0\.001; sbd\.full_block_prob"
  ):
    trainer.train(other, str(tmp_path))
  after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  assert after == before

  # The checkpoints' data positions are for 8 row shards (data 8): data x fsdp 2 would read
  # other row slices from them (repeating or skipping documents): refused, untouched.
  reshaped = tiny_train_config(steps=4)
  reshaped.mesh.shape = (2, 1, 4)
  with pytest.raises(
    config.ConfigError, match=r"data positions for 1 process\(es\) x 8 row shards .* this run "
    r"has 1 process\(es\) x 2 row shards"
  ):  # fmt: skip
    trainer.train(reshaped, str(tmp_path))
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

  longer = tiny_train_config(steps=4)  # more steps (a new mesh of 8 row shards...) may resume
  longer.checkpoint.keep = 3
  longer.mesh.shape = (2, 4, 1)
  trainer.train(longer, str(tmp_path))
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
