"""Tiny CPU run (the README main job): a 0.84M-parameter model learns the built-in word problems,
then decodes 512 held-out problems with NTP and with SBD, in about 9 minutes on 2 CPU cores.

    python -m sbd_jax.train --config=configs/tiny.py --workdir=/tmp/sbd_tiny

- Data: a word-level vocabulary built from the task (digits are single tokens), the
  column-by-column solutions, rows of 176 tokens (one problem, ~170 tokens with its EOS tail),
  8 rows per step.
- Schedule, the paper's order at small scale: the first 40 % of 2500 steps train NTP alone
  (half the tokens of an SBD step), the rest the SBD objective on the same optimizer state.
  Learning the task first makes the run robust to the training draw; BENCHMARKS.md gives the
  outcome of several training seeds.
- Attention chunks of one half row: an NTP row is one chunk, an SBD row [x ; x̂] two, whose
  never-visible pair the kernel skips.
- Departures from the paper, each a field below, because a model this small does not learn the
  paper's recipe in a CPU budget: blocks of 4 tokens (the paper draws k ~ U{2..16} and decodes
  blocks of 16), tiled from the completion's first token as decoding tiles them; 80 % of blocks
  masked whole, which is what a block's first forward sees and, at γ = 0.35, nearly all that
  decoding sees (the rest keep the paper's per-token masking at η ~ U(0, 1)); the MATP term
  weighted twice. A block of 4 still allows up to 4x fewer forwards.
- Peak lr 2e-3 with a cosine decay to zero, and weight decay that spares the embedding table:
  decayed, the rows of the four verbs of one sign (`finds`, `wins`, `buys`, `gets`) can
  collapse onto one direction, after which the model knows an event's sign but cannot copy its
  verb.
"""

from sbd_jax import config


def get_config():
  c = config.base_config()
  c.tokenizer = "words"  # built into <workdir>/tokenizer from the training problems
  c.data.arithmetic.solution = "columns"
  # The model is architectures.tiny() (4 layers, width 128) with room for the word vocabulary:
  c.model.vocab_size = 384  # 256 bytes + 4 specials + ~70 words
  c.model.attention_chunk = 176  # one chunk per half row
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
