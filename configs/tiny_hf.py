"""SBD fine-tune of a small converted Hugging Face model on a local jsonl file (CPU-sized).

  python -m sbd_jax.convert hf-to-orbax --hf_dir=HF --out=CONVERTED
  python -m sbd_jax.train --config=configs/tiny_hf.py:CONVERTED --workdir=RUN \
      --config.data.paths=train.jsonl

The `:CONVERTED` argument fills the model fields, tokenizer, sbd.mask_id and train.init_from
from CONVERTED/config.json. Without it the config keeps the tiny byte model as placeholders and
you must pass --config.train.init_from, --config.tokenizer, --config.sbd.mask_id and every
--config.model.* field of the converted model yourself.
"""

from sbd_jax import config


def get_config(converted_dir: str = ""):
  if converted_dir:
    from sbd_jax.hf.importer import finetune_config

    c = finetune_config(converted_dir)  # model fields, tokenizer, mask id, init_from
  else:
    c = config.base_config()
    c.data.source = "jsonl"
  c.data.paths = ""  # comma-separated jsonl globs ({"prompt", "completion"} or {"text"})
  c.train.steps = 100
  c.train.batch_size = 8
  c.train.seq_len = 128
  c.train.log_every = 10
  c.sbd.k_min, c.sbd.k_max = 2, 8
  c.sample.block_size = 8  # decode blocks no larger than the largest trained
  c.optim.lr = 1e-4  # fine-tuning a pretrained model: far below the from-scratch 3e-3
  c.optim.warmup_steps = 10
  c.checkpoint.every_steps = 50
  return c
