"""Tiny CPU run (the README main job): ~0.8M-parameter model on the built-in arithmetic task.

Sized for a 2-core CPU: ~0.9 s per SBD step (16 rows x 2 x 128 tokens), ~7 minutes of
training, then held-out decoding with NTP and SBD.
"""

from sbd_jax import config


def get_config():
  c = config.base_config()  # the tiny byte-level model and the arithmetic task
  c.train.steps = 450
  c.train.batch_size = 16
  c.train.seq_len = 128  # one ~110-token problem per row after first-fit packing
  c.train.log_every = 25
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 30
  c.checkpoint.every_steps = 150
  return c
