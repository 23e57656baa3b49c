"""What a decode needs in a device's memory, checked before anything is allocated: the KV
cache of its rows and the activations of its prefill.
"""

from __future__ import annotations

import numpy as np

from sbd_jax import sharding
from sbd_jax.model.architectures import ModelConfig


def decode_bytes_per_device(cfg: ModelConfig, rows: int, slots: int, ways: int = 1) -> int:
  """KV cache plus per-slot metadata of one decode batch, per device (rows split `ways`)."""
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.compute_dtype).itemsize
  meta = 3 * 4  # positions, block start (int32) and flags per slot, rounded up
  return -(-rows // ways) * slots * (kv + meta)


def prefill_bytes_per_device(
  cfg: ModelConfig, rows: int, tokens: int, slots: int, ways: int = 1
) -> int:
  """What one layer of a prefill forward of `tokens` tokens a row over a cache of `slots` holds
  at once, per device, beyond the cache: its activations (the residual stream, the attention's
  projections and the MLP's) and float32 attention scores and probabilities, over every slot
  (dense attention) or a chunk of them (a forward longer than a chunk: `transformer`)."""
  b = -(-rows // ways)
  keys = (
    slots
    if cfg.attention_impl == "dense" and tokens <= cfg.attention_chunk
    else cfg.attention_chunk
  )
  scores = 2 * b * cfg.num_heads * tokens * min(keys, slots) * 4
  width = 4 * cfg.embed_dim + 2 * cfg.num_heads * cfg.head_dim + 3 * cfg.mlp_dim
  return scores + b * tokens * width * np.dtype(cfg.compute_dtype).itemsize


def check_fits_in_memory(
  cfg: ModelConfig, rows: int, slots: int, ways: int = 1, prefill_tokens: int = 0
) -> None:
  """A one-line ValueError, before anything is allocated, when the decode's KV cache and the
  prefill of `prefill_tokens` tokens a row would not fit half of a device's memory (weights,
  logits and XLA's buffers need the rest)."""
  cache = decode_bytes_per_device(cfg, rows, slots, ways)
  prefill = (
    prefill_bytes_per_device(cfg, rows, prefill_tokens, slots, ways) if prefill_tokens else 0
  )
  have = sharding.device_memory_bytes()
  if cache + prefill > have // 2:
    raise ValueError(
      f"decoding {rows} rows x {slots} cache slots needs {cache / 2**30:.1f} GiB of KV cache and "
      f"{prefill / 2**30:.1f} GiB for the prefill of {prefill_tokens} tokens a row per device, "
      f"more than half of the device's {have / 2**30:.1f} GiB; lower max_new_tokens, the prompt "
      "length or the batch size"
    )
