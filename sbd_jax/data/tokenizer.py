"""Tokenizer interface used by the data pipeline and the sampler.

`Tokenizer` is a structural Protocol: any object with these attributes and methods works (e.g. a
Hugging Face `tokenizers` wrapper). `ByteTokenizer` is the dependency-free built-in.
"""

from collections.abc import Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
  """Text <-> ids. `encode` adds no special tokens; `decode` drops special ids."""

  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int
  mask_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then pad=256, bos=257, eos=258, mask=259."""

  vocab_size: int = 260
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  mask_id: int = 259

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes every byte id (no stop at eos); special and out-of-range ids are skipped."""
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


def validate_special_ids(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises ValueError if the tokenizer's ids do not fit a model with `model_vocab_size` rows."""
  t = tokenizer
  if t.vocab_size > model_vocab_size:
    raise ValueError(
      f"tokenizer vocab_size {t.vocab_size} exceeds model vocab_size {model_vocab_size}"
    )
  if not 0 <= t.mask_id < model_vocab_size:
    raise ValueError(f"mask_id {t.mask_id} is outside [0, {model_vocab_size})")
  clashes = [name for name in ("eos", "bos", "pad") if getattr(t, f"{name}_id") == t.mask_id]
  if clashes:
    raise ValueError(f"mask_id {t.mask_id} equals the {'/'.join(clashes)} id")
