"""Tiny CPU run (the README main job): a 0.84M-parameter model on the built-in word problems.

Sized on a 2-core CPU (BENCHMARKS.md, "The README main job"): a word-level vocabulary built
from the task (digits are single tokens), the column-by-column solutions, rows of 176 tokens
(one problem, ~170 tokens with its EOS tail, per row), about 0.34 s per SBD step (8 rows x
2 x 176 tokens), 1400 steps (about 8.5 minutes), then 512 held-out problems decoded with NTP
and with SBD.

SBD blocks of 4 tokens, trained where and mostly as decoding meets them: from the completion's
first token, and 80 % of them masked whole, which is what a block's first forward sees and, at
γ = 0.35, nearly all that decoding sees (most blocks come out of that one forward); the other
20 % keep the paper's per-token masking at η ~ U(0, 1), for the later forwards of partly revealed
blocks. At this size and budget the masked prediction learns blocks of 4 several times faster
than the paper's k ~ U{2..16}, and whole-masked blocks cut the SBD-vs-NTP gap at γ = 0.35 from
about 22 points (30 % masked whole) to 2-4 (BENCHMARKS.md); a block of 4 still allows up to 4x
fewer forwards.
"""

from sbd_jax import config


def get_config():
  c = config.base_config()
  c.tokenizer = "words"  # built into <workdir>/tokenizer from the training problems
  c.data.arithmetic.solution = "columns"
  # The model is architectures.tiny() (4 layers, width 128) with room for the word vocabulary:
  c.model.vocab_size = 384  # 256 bytes + 4 specials + ~70 words
  c.sbd.k_min = c.sbd.k_max = 4
  c.sbd.block_anchor = "completion"
  c.sbd.full_block_prob = 0.8  # the paper masks per token at η ~ U(0, 1) (full_block_prob 0)
  c.train.steps = 1400
  c.train.batch_size = 8
  c.train.seq_len = 176
  c.train.log_every = 50
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 60
  c.checkpoint.every_steps = 700
  c.sample.block_size = 4
  c.sample.batch_size = 128
  return c
