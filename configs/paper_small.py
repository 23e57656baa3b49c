"""The paper's SBD recipe at CPU scale: configs/tiny.py's model, data and optimizer, trained and
decoded the way configs/llama8b.py trains and decodes.

    python -m sbd_jax.train --config=configs/paper_small.py --workdir=/tmp/sbd_paper_small

Kept from the 8B recipe (`config.apply_8b_finetune_recipe`): k ~ U{2..16} drawn per step,
decode blocks of 16, per-token masking at η ~ U(0, 1) with no whole-masked share, NTP and MATP
weighed equally, blocks tiled over the row, block positions past EOS trained to EOS.

Changed because of scale, as configs/tiny.py changes them: the 0.84M-parameter model, the built-in
word problems, one problem per row, 8 rows per step, peak lr 2e-3 with a cosine decay to zero and no
weight decay on the embeddings. The 8B recipe fine-tunes a pretrained model; here the first 30 %
of the steps train NTP alone, which plays that part.
"""

import pathlib

from sbd_jax import config


def get_config():
  c = config.from_file(str(pathlib.Path(__file__).with_name("tiny.py")))
  recipe = config.apply_8b_finetune_recipe(config.base_config())
  for field in ("k_min", "k_max", "eta_beta", "full_block_prob", "matp_weight", "block_anchor"):
    c.sbd[field] = recipe.sbd[field]
  c.sbd.train_past_eos = recipe.sbd.train_past_eos
  c.sample.block_size = recipe.sample.block_size
  # Rows of 192 tokens (12 blocks of 16): a problem with its 15-token EOS tail is up to 185.
  c.train.seq_len = 192
  c.model.attention_chunk = 192  # one chunk per half row
  c.train.steps = 6000
  c.sbd.ntp_fraction = 0.3  # steps 0-1799 NTP alone: the model the fine-tune starts from
  c.checkpoint.every_steps = 2000
  return c
