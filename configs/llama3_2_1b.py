"""SBD fine-tune of Llama-3.2 1B on one GPU, with the 8B configs' recipe.

    python -m sbd_jax.train --config=configs/llama3_2_1b.py --workdir=/tmp/llama1b \
        --config.train.init_from=CONVERTED/params --config.tokenizer=CONVERTED/tokenizer.json \
        --config.data.paths='/data/sft/*.jsonl'
    python -m benchmarks.train_step --config=configs/llama3_2_1b.py --out=DIR

The paper's recipe as configs/llama8b.py applies it (`config.apply_8b_finetune_recipe`: k ~
U{2..16}, per-token η ~ U(0, 1), equal weights, AdamW at 3e-4, row-tiled blocks, EOS tail), on
one device: rows of 4096 tokens, 8 per step (32k tokens; the SBD step processes 64k), every
layer rematerialised (the whole-step activations of 64k processed tokens do not fit an 80 GB
GPU otherwise). The attention is the chunked kernel (splash is TPU-only); blocks still tile the
row, as in the 8B configs, so that a run here and on a pod train the same objective.
"""

from sbd_jax import config
from sbd_jax.model import architectures


def get_config():
  c = config.apply_8b_finetune_recipe(config.base_config(architectures.llama3_2_1b(remat="full")))
  c.train.init_from = ""  # converted Orbax params of meta-llama/Llama-3.2-1B(-Instruct)
  c.sbd.mask_id = 128_002  # <|reserved_special_token_0|>, unused by the base and instruct models
  c.train.seq_len = 4096
  c.train.batch_size = 8
  return c
