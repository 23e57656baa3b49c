"""Tiny CPU run (the README main job): ~0.8M-parameter model on the built-in arithmetic task."""

from sbd_jax import config


def get_config():
  c = config.base_config()  # the tiny byte-level model and the arithmetic task
  c.train.steps = 300
  c.train.batch_size = 16
  c.train.seq_len = 256
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 30
  c.checkpoint.every_steps = 100
  return c
