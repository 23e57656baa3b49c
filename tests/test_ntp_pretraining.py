"""`sbd.ntp_steps`: an NTP pretraining phase, then SBD on the same state (the paper fine-tunes
an NTP-pretrained model; a run from scratch can do both in one command)."""

import json
import os

from sbd_jax import trainer


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


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
