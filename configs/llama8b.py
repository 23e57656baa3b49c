"""SBD fine-tune of Llama-3.1 8B with the paper's recipe (TPU pod / multi-GPU)."""

from sbd_jax import config
from sbd_jax.model import architectures


def get_config():
  c = config.apply_8b_finetune_recipe(config.base_config(architectures.llama3_1_8b()))
  c.train.init_from = ""  # converted Orbax params of meta-llama/Llama-3.1-8B(-Instruct)
  c.sbd.mask_id = 128_002  # <|reserved_special_token_0|>, unused by the base and instruct models
  return c
