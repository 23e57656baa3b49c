"""`sbd.ntp_steps` / `sbd.ntp_fraction`: an NTP pretraining phase, then SBD on the same state (the paper fine-tunes
an NTP-pretrained model; a run from scratch can do both in one command)."""

import json
import os

import pytest

from sbd_jax import config as config_lib
from sbd_jax.training import trainer


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.integration  # a training run
def test_first_steps_train_ntp_alone_then_sbd_takes_over(tmp_path, tiny_train_config):
  c = tiny_train_config(steps=6)
  c.sbd.ntp_steps = 3
  trainer.train(c, str(tmp_path))
  records = read_metrics(tmp_path)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  for r in records[:3]:  # NTP steps: no masked tokens, no block, the loss is the NTP term
    assert r["masked_tokens"] == 0 and r["matp_loss"] == 0 and r["block_size"] == 0
    assert r["loss"] == r["ntp_loss"]
  for r in records[3:]:
    assert r["masked_tokens"] > 0 and r["matp_loss"] > 0 and 2 <= r["block_size"] <= 16
  # The NTP step processes L tokens per row, the SBD step 2L; both phases report it.
  assert all(r["processed_tokens_per_s"] > 0 for r in records[1:])


def test_the_phase_as_a_share_of_the_run_scales_with_its_length(tiny_train_config):
  """`sbd.ntp_fraction` (configs/tiny.py's way): the floor of that share of train.steps, so a
  shortened run keeps its proportions; NTP runs have no phase."""
  c = tiny_train_config(steps=1750)
  c.sbd.ntp_fraction = 0.4
  assert config_lib.ntp_phase_steps(c) == 700
  for steps, phase in ((10, 4), (3, 1), (1, 0)):
    c.train.steps = steps
    assert config_lib.ntp_phase_steps(c) == phase
    config_lib.validate(c)
  c.sbd.mode = "ntp"
  assert config_lib.ntp_phase_steps(c) == 0
  c.sbd.mode, c.sbd.ntp_steps, c.train.steps = "sbd", 2, 10
  with pytest.raises(config_lib.ConfigError, match="not both"):
    config_lib.validate(c)
  c.sbd.ntp_steps, c.sbd.ntp_fraction = 0, 1.0
  with pytest.raises(config_lib.ConfigError, match=r"ntp_fraction \(1.0\) must be in \[0, 1\)"):
    config_lib.validate(c)
