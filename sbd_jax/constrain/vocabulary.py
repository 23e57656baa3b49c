"""The bytes each token id decodes to: what a token automaton is compiled over.

`TokenVocabulary.from_tokenizer` reads the project's tokenizers (`sbd_jax.data.tokenizer`):

* `ByteTokenizer`: ids 0..255 are their byte.
* `HFTokenizer` over a tokenizer.json: the token strings through its decoder, token by token:
  `ByteLevel` (Llama-3, Qwen-3: each character stands for one byte, GPT-2's table; a character
  outside it for its UTF-8 bytes, as `tokenizers` decodes added tokens), `ByteFallback`
  ("<0xNN>" is byte NN: the project's word vocabulary, `sbd_jax.data.vocab`), `Replace` of a
  fixed string and `Fuse`. Decoders whose output depends on a token's neighbours (Strip,
  Metaspace, WordPiece, none at all: tokens joined by spaces) are refused.

Special ids (pad, bos, eos, mask and the tokenizer's special added tokens), ids past the
tokenizer's vocabulary (up to the model's `vocab_size`) and tokens that decode to nothing get no
bytes: a constrained state never allows them. EOS is the automaton's end token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence

from sbd_jax.constrain.spec import ConstraintError

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_table() -> dict[str, int]:
  """GPT-2's byte-level alphabet: character -> the byte it stands for."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  chars, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      chars[chr(byte)] = byte
    else:
      chars[chr(256 + extra)] = byte
      extra += 1
  return chars


@dataclasses.dataclass(frozen=True, eq=False)
class TokenVocabulary:
  """`token_bytes[i]`: what id i decodes to, or None where it is never allowed (one entry per
  logit: the model's vocabulary). `fingerprint` names the contents (the compile cache's key)."""

  token_bytes: tuple[bytes | None, ...]
  eos_id: int
  mask_id: int
  fingerprint: str = dataclasses.field(default="", init=False)

  def __post_init__(self):
    v = len(self.token_bytes)
    for name in ("eos_id", "mask_id"):
      if not 0 <= getattr(self, name) < v:
        raise ConstraintError(f"{name} {getattr(self, name)} is outside the vocabulary [0, {v})")
    if self.token_bytes[self.eos_id] is not None or self.token_bytes[self.mask_id] is not None:
      raise ConstraintError("eos and mask must have no bytes (they are never text)")
    digest = hashlib.sha256(f"{v} {self.eos_id} {self.mask_id}".encode())
    for token in self.token_bytes:
      digest.update(b"-" if token is None else len(token).to_bytes(4, "little") + token)
    object.__setattr__(self, "fingerprint", digest.hexdigest()[:32])

  @property
  def vocab_size(self) -> int:
    return len(self.token_bytes)

  @classmethod
  def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> TokenVocabulary:
    """The vocabulary of a project tokenizer; `vocab_size`: the model's logits (default the
    tokenizer's vocabulary), at least the tokenizer's."""
    v = tokenizer.vocab_size if vocab_size is None else vocab_size
    if v < tokenizer.vocab_size:
      raise ConstraintError(f"vocab_size {v} is below the tokenizer's {tokenizer.vocab_size}")
    inner = getattr(tokenizer, "tokenizer", None)
    tokens = _byte_tokens() if inner is None else _hf_tokens(tokenizer, inner)
    specials = {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id}
    table = [None if i in specials else tokens.get(i) for i in range(v)]
    return cls(tuple(table), eos_id=tokenizer.eos_id, mask_id=tokenizer.mask_id)


def _byte_tokens() -> dict[int, bytes]:
  return {b: bytes([b]) for b in range(256)}


def _decoder_steps(inner) -> list[dict]:
  """The tokenizer's decoders in order (a Sequence flattened); refused where unsupported."""
  if inner.decoder is None:
    raise ConstraintError("a tokenizer without a decoder joins tokens with spaces: unsupported")
  steps, todo = [], [json.loads(inner.decoder.__getstate__())]
  while todo:
    step = todo.pop(0)
    if step["type"] == "Sequence":
      todo = list(step["decoders"]) + todo
    elif step["type"] in ("ByteLevel", "ByteFallback", "Fuse"):
      steps.append(step)
    elif step["type"] == "Replace" and "String" in step["pattern"]:
      steps.append(step)
    else:
      raise ConstraintError(f"tokenizer decoder {step['type']} is not supported by constraints")
  return steps


def token_bytes(token: str, steps: Sequence[dict], byte_of: dict[str, int]) -> bytes:
  """What one token string decodes to through `steps`."""
  value: str | bytes = token
  for step in steps:
    if not isinstance(value, str):
      break
    if step["type"] == "Replace":
      value = value.replace(step["pattern"]["String"], step["content"])
    elif step["type"] == "ByteFallback" and (hexa := BYTE_FALLBACK.fullmatch(value)):
      value = bytes([int(hexa.group(1), 16)])
    elif step["type"] == "ByteLevel":
      value = b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in value)
  return value.encode("utf-8") if isinstance(value, str) else value


def _hf_tokens(tokenizer, inner) -> dict[int, bytes]:
  """id -> bytes for every non-special id of a `tokenizers.Tokenizer` that decodes to text."""
  steps, byte_of = _decoder_steps(inner), byte_level_table()
  special = {i for i, t in inner.get_added_tokens_decoder().items() if t.special}
  tokens = {}
  for text, i in inner.get_vocab(with_added_tokens=True).items():
    if i not in special and i < tokenizer.base_vocab_size:
      data = token_bytes(text, steps, byte_of)
      if data:
        tokens[i] = data
  return tokens
