"""Hugging Face interop: config and parameter maps, tokenizer, import and export.

Needs the `hf` extra (safetensors, tokenizers); `transformers` itself is only used by tests.
"""

from sbd_jax.data.tokenizer import HFTokenizer, TokenizerError
from sbd_jax.hf.config_map import HFConversionError, hf_config_from_model, model_config_from_hf

__all__ = [
  "HFConversionError",
  "HFTokenizer",
  "TokenizerError",
  "hf_config_from_model",
  "model_config_from_hf",
]
