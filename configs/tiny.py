"""Tiny CPU run (the README main job): a 0.22M-parameter model on the built-in word problems.

Sized on a 2-core CPU (see BENCHMARKS.md, "Sizing the tiny run"): a word-level vocabulary built
from the task (digits are single tokens), rows of 256 tokens so that no problem (~120 tokens plus
its EOS tail) is cut across rows, ~0.6 s per SBD step (8 rows x 2 x 256 tokens), about 7
minutes of training, then 512 held-out problems decoded with NTP and with SBD.
"""

from sbd_jax import config


def get_config():
  c = config.base_config()
  c.tokenizer = "words"  # built into <workdir>/tokenizer from the training problems
  # The one-equation solutions: within 10 minutes this 0.22M model gets 7 % NTP on them and 2 %
  # on the (default) column-by-column solutions, which help from width 128 up (BENCHMARKS.md).
  c.data.arithmetic.solution = "sentences"
  c.model.vocab_size = 384  # 256 bytes + 4 specials + ~100 words
  c.model.embed_dim = 64
  c.model.head_dim = 16
  c.model.mlp_dim = 192
  c.train.steps = 700
  c.train.batch_size = 8
  c.train.seq_len = 256
  c.train.log_every = 50
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 30
  c.checkpoint.every_steps = 350
  c.sample.batch_size = 128
  return c
