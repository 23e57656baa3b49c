"""The paper's 3B ablation model (28 layers, width 3072), trained with SBD from scratch.

Set --config.sbd.mode=matp_only for the "no NTP term" ablation, ntp for the baseline.
"""

from sbd_jax import config
from sbd_jax.model import architectures


def get_config():
  c = config.base_config(architectures.ablation_3b())
  c.tokenizer = ""  # a Llama-3 tokenizer.json
  c.sbd.mask_id = 128_002
  c.sbd.block_anchor = "row"  # splash attention (the preset's kernel) needs row-tiled blocks
  c.train.seq_len = 8192
  c.train.batch_size = 256
  c.train.steps = 100_000
  c.train.loss_chunk = 2048  # never the whole [2 x 8k x 128k] logits
  c.optim.lr = 1.5e-3  # paper: pretraining lr 1.5e-3 with 2000 warm-up steps
  c.optim.warmup_steps = 2000
  c.mesh.shape = (1, -1, 1)
  c.data.source = "tfds"
  c.checkpoint.every_steps = 2000
  return c
