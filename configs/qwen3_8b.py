"""SBD fine-tune of Qwen-3 8B with the paper's recipe (TPU pod / multi-GPU)."""

from sbd_jax import config
from sbd_jax.model import architectures


def get_config():
  c = config.apply_8b_finetune_recipe(config.base_config(architectures.qwen3_8b()))
  c.train.init_from = ""  # converted Orbax params of Qwen/Qwen3-8B
  c.sbd.mask_id = 151_669  # first id after Qwen-3's last added token; rows to 151,935 are unused
  return c
