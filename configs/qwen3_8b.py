"""SBD fine-tune of Qwen-3 8B with the paper's recipe (TPU pod / multi-GPU)."""

from sbd_jax import architectures
from sbd_jax import config


def get_config():
  c = config.base_config(architectures.qwen3_8b())
  c.tokenizer = ""  # path to the converted model's tokenizer.json (python -m sbd_jax.convert)
  c.train.init_from = ""  # converted Orbax params of Qwen/Qwen3-8B
  c.sbd.mask_id = 151_669  # first id after Qwen-3's last added token (151,668); rows up to 151,935 are unused
  c.sbd.k_min, c.sbd.k_max = 2, 16
  c.train.seq_len = 32_768
  c.train.batch_size = 64
  c.train.steps = 34_000
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 200
  c.optim.end_lr_ratio = 0.0
  c.mesh.shape = (1, -1, 1)
  c.data.source = "jsonl"
  c.checkpoint.every_steps = 1000
  c.model.attention_chunk = 1024
  return c
