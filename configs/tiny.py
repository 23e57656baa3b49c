"""Tiny CPU run (the README main job): a 0.84M-parameter model on the built-in word problems.

Sized on a 2-core CPU (BENCHMARKS.md, "The README main job"): a word-level vocabulary built
from the task (digits are single tokens), the column-by-column solutions, rows of 176 tokens
(one problem, ~170 tokens with its EOS tail, per row), 8 rows per step, then 512 held-out
problems decoded with NTP and with SBD.

Training follows the paper's order on a small scale: the first 1000 steps train NTP alone (half
the tokens of an SBD step, about 0.10 s here), the next 1500 the SBD objective (about 0.24 s).
Learning the task first made it robust to the training draw: 1400 SBD steps from scratch
learned it on train.seed 0 but reached only 24 % / 60 % NTP exact match on seeds 1 / 2.

2500 steps (2000 in session 24, 1750 before): at 2000, seeds 3 and 4 did not learn the task
(SBD 86.5 %; NTP 59.8 %). Session 25 made the train steps about 1.45x cheaper: the MLP's weight
gradients from one copy of x^T (`model.mlp_grads_transpose_input`, on in architectures.tiny)
and a faster attention kernel. That pays for 2500 steps in about the old 2000 steps' time. Now
every seed of 0-4 learns NTP (100 %), and SBD at γ = 0.35 reaches 92.6-100 % (BENCHMARKS.md,
session 25). Attention chunks of one half row (176): an NTP row is one chunk, an SBD row two.

SBD blocks of 4 tokens, trained where and mostly as decoding meets them: from the completion's
first token, and 80 % of them masked whole, which is what a block's first forward sees and, at
γ = 0.35, nearly all that decoding sees (most blocks come out of that one forward); the other
20 % keep the paper's per-token masking at η ~ U(0, 1), for the later forwards of partly revealed
blocks. A block of 4 still allows up to 4x fewer forwards; this model does not learn the
paper's k ~ U{2..16} in 10 minutes. MATP weighted twice, peak lr 2e-3 and a cosine decay to zero.

Weight decay spares the embedding table (`optim.decay_embeddings`). Decayed, the rows of the
four verbs of one sign (`finds`, `wins`, `buys`, `gets`) collapsed onto one direction (cosine
0.95-0.96) on some machines: the model then knew an event's sign but could not copy its verb,
and NTP fell to 55.7 % exact match with the same seed that gave 100 % elsewhere (BENCHMARKS.md,
session 23).
"""

from sbd_jax import config


def get_config():
  c = config.base_config()
  c.tokenizer = "words"  # built into <workdir>/tokenizer from the training problems
  c.data.arithmetic.solution = "columns"
  # The model is architectures.tiny() (4 layers, width 128) with room for the word vocabulary:
  c.model.vocab_size = 384  # 256 bytes + 4 specials + ~70 words
  # One attention chunk per half row: an NTP row is one chunk, an SBD row [x ; x̂] two (the
  # kernel skips their never-visible pair at any chunk). Steps take 0.100 s (NTP) and 0.247 s
  # (SBD), against 0.113 / 0.259 s with the default chunk of 128, which cuts each half into two
  # chunks of 88 (python -m sbd_jax.benchmarks.train_step --rows=8 --seq_len=176).
  c.model.attention_chunk = 176
  c.sbd.k_min = c.sbd.k_max = 4
  c.sbd.block_anchor = "completion"
  c.sbd.full_block_prob = 0.8  # the paper masks per token at η ~ U(0, 1) (full_block_prob 0)
  c.train.steps = 2500
  c.sbd.ntp_fraction = 0.4  # steps 0-999 NTP alone (the paper fine-tunes an NTP model), then SBD
  c.train.batch_size = 8
  c.train.seq_len = 176
  c.train.log_every = 50
  c.sbd.matp_weight = 2.0  # the paper weighs MATP and NTP equally (1.0)
  c.optim.lr = 2e-3
  c.optim.warmup_steps = 60
  c.optim.end_lr_ratio = 0.0  # cosine to zero: the last steps settle instead of wandering
  c.optim.decay_embeddings = False  # decay collapses the verbs' rows (module docstring)
  c.checkpoint.every_steps = 1250
  c.sample.block_size = 4
  c.sample.batch_size = 128
  return c
