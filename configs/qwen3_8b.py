"""SBD fine-tune of Qwen-3 8B with the paper's recipe, for a TPU pod slice (or many GPUs).

    python -m sbd_jax.train --config=configs/qwen3_8b.py --workdir=gs://BUCKET/run \
        --config.train.init_from=CONVERTED/params --config.tokenizer=CONVERTED/tokenizer.json \
        --config.data.paths='/data/sft/*.jsonl'

The recipe and this project's two choices beyond it (row-tiled blocks, positions past EOS
trained to EOS) are configs/llama8b.py's; only the architecture and the mask token differ.
"""

from sbd_jax import config
from sbd_jax.model import architectures


def get_config():
  c = config.apply_8b_finetune_recipe(config.base_config(architectures.qwen3_8b()))
  c.train.init_from = ""  # converted Orbax params of Qwen/Qwen3-8B
  c.sbd.mask_id = 151_669  # first id after Qwen-3's last added token; rows to 151,935 are unused
  return c
