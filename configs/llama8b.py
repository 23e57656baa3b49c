"""SBD fine-tune of Llama-3.1 8B with the paper's recipe, for a TPU pod slice (or many GPUs).

    python -m sbd_jax.aot --config=configs/llama8b.py --topology=v5p-128      # fits? (no TPU)
    python -m sbd_jax.train --config=configs/llama8b.py --workdir=gs://BUCKET/run \
        --config.train.init_from=CONVERTED/params --config.tokenizer=CONVERTED/tokenizer.json \
        --config.data.paths='/data/sft/*.jsonl'

Hub datasets train as the Hub ships them, through a field map (`data.fields`), e.g. the
OpenMathReasoning shards:

        --config.data.source=parquet --config.data.paths='/data/omr/data/cot-*.parquet' \
        --config.data.fields.prompt=problem --config.data.fields.completion=generated_solution

and ShareGPT-style chats with `fields.messages=conversations fields.role=from
fields.content=value` (human / gpt roles are renamed by `fields.roles`). The paper fine-tunes on
reasoning and instruct data together; as a weighted mixture (`data.mixture`; the weights here
are an example, set your own), in a config that starts from this one:

    c.data.mixture = (
        dict(weight=0.5, source="parquet", paths="/data/OpenMathReasoning/data/cot-*.parquet",
             fields=dict(prompt="problem", completion="generated_solution")),
        dict(weight=0.3, source="parquet", paths="/data/OpenCodeReasoning/split_0/*.parquet",
             fields=dict(prompt="input", completion="output")),
        dict(weight=0.2, source="parquet", paths="/data/instruct/*.parquet",
             fields=dict(messages="conversations", role="from", content="value")),
    )

Held-out losses (NTP, and MATP per masked token at masking rates 0.25 to 1) are logged every
`train.eval_every` steps as heldout/* on the last `data.holdout` documents of each source, or on
files of their own (`eval.paths`, `eval.mixture`); `python -m sbd_jax.plot_metrics` draws them.

The paper's recipe (`config.apply_8b_finetune_recipe`): AdamW at lr 3e-4 with 200 warm-up steps
and a cosine decay, 2M-token batches (64 rows x 32k tokens), 34k steps, k ~ U{2..16} drawn per
step, per-token masking at η ~ U(0, 1), NTP and MATP weighed equally, FSDP over every device.
Two choices of this project that the paper does not make, each a field: blocks tile the packed
row (`sbd.block_anchor="row"`: splash attention's static mask needs it; the paper tiles each
document from its start, so a document's first and last block are cut at its boundaries here),
and the block positions past a document's EOS are trained to predict EOS
(`sbd.train_past_eos`), as decoding meets them. Training stops with a one-line error while
`train.init_from` is empty: the recipe fine-tunes a pretrained model (`train.init_from=random`
starts from random weights on purpose).
"""

from sbd_jax import config
from sbd_jax.model import architectures


def get_config():
  c = config.apply_8b_finetune_recipe(config.base_config(architectures.llama3_1_8b()))
  c.train.init_from = ""  # converted Orbax params of meta-llama/Llama-3.1-8B(-Instruct)
  c.sbd.mask_id = 128_002  # <|reserved_special_token_0|>, unused by the base and instruct models
  return c
