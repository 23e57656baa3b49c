"""Pick the tokenizer a config names: the built-in byte tokenizer or a Hugging Face one."""

from __future__ import annotations

from sbd_jax.data.tokenizer import ByteTokenizer, Tokenizer


def load_tokenizer(name: str, mask_id: int = -1) -> Tokenizer:
  """ "byte" -> ByteTokenizer; otherwise a path to a tokenizer.json or a directory holding one."""
  if name == "byte":
    return ByteTokenizer()
  if not name:
    raise ValueError("config.tokenizer is empty: set it to 'byte' or to a tokenizer.json path")
  from sbd_jax.hf.tokenizer import HFTokenizer  # optional dependency: `pip install .[hf]`

  return HFTokenizer.from_path(name, mask_id=mask_id)
