"""SBD fine-tune of Llama-3.1 8B with the paper's recipe (TPU pod / multi-GPU)."""

from sbd_jax import architectures
from sbd_jax import config


def get_config():
  c = config.base_config(architectures.llama3_1_8b())
  c.tokenizer = ""  # path to the converted model's tokenizer.json (python -m sbd_jax.convert)
  c.train.init_from = ""  # converted Orbax params of meta-llama/Llama-3.1-8B(-Instruct)
  c.sbd.mask_id = 128_002  # <|reserved_special_token_0|>, unused by the base and instruct models
  c.sbd.k_min, c.sbd.k_max = 2, 16
  c.train.seq_len = 32_768  # paper: 32k context
  c.train.batch_size = 64  # 64 x 32k = 2M tokens per step (paper)
  c.train.steps = 34_000  # paper: 34k steps, ~70B tokens
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 200
  c.optim.end_lr_ratio = 0.0
  c.optim.weight_decay = 0.1
  c.mesh.shape = (1, -1, 1)  # FSDP over every device; set tensor > 1 for large slices
  c.data.source = "jsonl"
  c.checkpoint.every_steps = 1000
  c.model.attention_chunk = 1024
  return c
