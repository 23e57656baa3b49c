"""Tokenizers: one `Tokenizer` interface and its two implementations.

* `ByteTokenizer`: UTF-8 bytes as ids 0..255, then pad, bos, eos and mask. No dependencies.
* `HFTokenizer`: a Hugging Face `tokenizer.json` (a converted Llama-3 / Qwen-3 tokenizer, or the
  word-level vocabulary `sbd_jax.data.vocab` builds for small models).

`load_tokenizer(config.tokenizer, workdir)` picks one: "byte", "words" (the vocabulary saved in
<workdir>/tokenizer/ at the start of training) or a path to a tokenizer.json or its directory.

Documents and prompts are encoded with `encode_document`: BOS where the tokenizer's own
convention puts one. A converted Hugging Face tokenizer encodes exactly as `transformers`'
`tokenizer(text)["input_ids"]` does (its post-processor decides: Llama-3 adds
`<|begin_of_text|>`, Qwen-3 adds nothing); the byte tokenizer and the project's word vocabulary
always start with their BOS (`prepend_bos`). Packed documents are kept apart by segment ids and
their EOS, never by a forced BOS.

HFTokenizer's special ids come from `tokenizer_config.json` (or `special_tokens_map.json`)
beside the tokenizer.json; missing ones fall back as follows (documented choices):

* bos: Qwen-3 has none; `bos_id` then falls back to `<|endoftext|>` (Qwen's document separator)
  if present, else to eos. It only fills the attribute: `encode_document` adds no token the
  tokenizer itself would not.
* pad: Llama-3.1 has none; it falls back to `<|finetune_right_pad_id|>` (Llama-3.1's dedicated
  pad token) if present, else to eos. Padding never reaches a loss (its loss mask is 0).
* mask (SBD's `m`): the `mask_token` of tokenizer_config.json if it names one; else
  `<|reserved_special_token_0|>` (Llama-3: id 128002) if present; otherwise
  the first id past the tokenizer's vocabulary (Qwen-3: 151669, one of the unused embedding rows
  151669..151935 that no text encodes to). Override with `mask_token` (a token string, or an
  id as a decimal string) or `mask_id`. The mask must differ from eos/bos/pad and, when
  `model_vocab_size` is given, lie inside the model's embedding table.

`vocab_size` is max(tokenizer vocabulary, mask_id + 1), so the trainer's check
`tokenizer.vocab_size <= model.vocab_size` also proves the mask has an embedding row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from etils import epath

from sbd_jax.paths import is_remote

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json")
WORKDIR_TOKENIZER_DIR = "tokenizer"  # <workdir>/tokenizer/: the "words" vocabulary of a run
MASK_CANDIDATES = ("<|reserved_special_token_0|>",)
BOS_FALLBACKS = ("<|endoftext|>",)
PAD_FALLBACKS = ("<|finetune_right_pad_id|>",)


@runtime_checkable
class Tokenizer(Protocol):
  """Text <-> ids. `encode` adds no special tokens; `decode` drops special ids."""

  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int
  mask_id: int

  def encode(self, text: str) -> list[int]: ...

  def encode_document(self, text: str) -> list[int]:
    """Ids of `text` at the start of a document or prompt (BOS where the tokenizer adds one)."""
    ...

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

  def encode_document(self, text: str) -> list[int]:
    return [self.bos_id, *self.encode(text)]

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes every byte id (no stop at eos); special and out-of-range ids are skipped."""
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


def load_tokenizer(name: str, workdir: str | None = None, mask_id: int = -1) -> Tokenizer:
  """ "byte" -> ByteTokenizer; "words" -> <workdir>/tokenizer/; else a tokenizer.json path."""
  if name == "byte":
    return ByteTokenizer()
  if not name:
    raise ValueError("config.tokenizer is empty: set 'byte', 'words' or a tokenizer.json path")
  if name == "words":
    if workdir is None:
      raise ValueError("tokenizer 'words' lives in a workdir; none was given")
    path = os.path.join(workdir, WORKDIR_TOKENIZER_DIR)
    if not epath.Path(path, TOKENIZER_FILE).is_file():
      raise FileNotFoundError(f"no word vocabulary at {path}: it is built when training starts")
    return HFTokenizer.from_path(path, mask_id=mask_id, prepend_bos=True)
  return HFTokenizer.from_path(name, mask_id=mask_id)


class TokenizerError(ValueError):
  """A tokenizer file or special-token choice that cannot work (one-line message)."""


def _token_string(value: Any) -> str | None:
  if isinstance(value, dict):  # {"content": "<|...|>", "lstrip": ...}
    value = value.get("content")
  return value or None


def _read_json(path: str) -> dict[str, Any]:
  """A JSON file (local or in a bucket), or {} when there is none."""
  file = epath.Path(path)
  return json.loads(file.read_text(encoding="utf-8")) if file.exists() else {}


def resolve_tokenizer_file(path_or_dir: str) -> str:
  """The tokenizer.json a path names (the file, or its directory), local or in a bucket."""
  path = path_or_dir if is_remote(path_or_dir) else os.path.expanduser(path_or_dir)
  if epath.Path(path).is_dir():
    path = os.path.join(path, TOKENIZER_FILE)
  if not epath.Path(path).is_file():
    raise TokenizerError(
      f"no tokenizer.json at {path!r} (only fast tokenizers, saved as "
      "tokenizer.json, are supported)"
    )
  return path


class HFTokenizer:
  """Text <-> ids with a `tokenizers.Tokenizer`; encode adds no specials, decode skips them.
  `prepend_bos`: documents start with `bos_id` (the word vocabulary's convention) instead of
  whatever the tokenizer's post-processor adds (a converted HF tokenizer's)."""

  def __init__(
    self,
    tokenizer,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    mask_id: int,
    path: str = "",
    prepend_bos: bool = False,
  ):
    self.tokenizer = tokenizer
    self.path = path
    self.prepend_bos = prepend_bos
    self.bos_id, self.eos_id, self.pad_id, self.mask_id = bos_id, eos_id, pad_id, mask_id
    self.base_vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.vocab_size = max(self.base_vocab_size, mask_id + 1)
    added = tokenizer.get_added_tokens_decoder()
    self._special_ids = {
      mask_id,
      bos_id,
      eos_id,
      pad_id,
      *(i for i, t in added.items() if t.special),
    }

  @classmethod
  def from_path(
    cls,
    path_or_dir: str,
    mask_id: int = -1,
    *,
    mask_token: str | None = None,
    model_vocab_size: int | None = None,
    prepend_bos: bool = False,
  ) -> "HFTokenizer":
    """Load tokenizer.json (a file, or a directory holding it) and its special-token sidecars."""
    import tokenizers  # optional dependency: pip install .[hf]

    path = resolve_tokenizer_file(path_or_dir)
    tok = tokenizers.Tokenizer.from_str(epath.Path(path).read_text(encoding="utf-8"))
    folder = os.path.dirname(path)
    specials: dict[str, Any] = {}
    for name in reversed(TOKENIZER_SIDECARS):  # tokenizer_config.json wins
      specials.update(
        {
          k: v
          for k, v in _read_json(os.path.join(folder, name)).items()
          if k in ("bos_token", "eos_token", "pad_token", "mask_token")
        }
      )
    vocab = tok.get_vocab(with_added_tokens=True)

    def lookup(role: str, fallbacks: Iterable[str] = ()) -> int | None:
      name = _token_string(specials.get(f"{role}_token"))
      if name is not None:
        if name not in vocab:
          raise TokenizerError(f"{role}_token {name!r} from {folder} is not in the vocabulary")
        return vocab[name]
      return next((vocab[f] for f in fallbacks if f in vocab), None)

    eos = lookup("eos")
    if eos is None:
      raise TokenizerError(
        f"{folder}: no eos_token in tokenizer_config.json / special_tokens_map.json"
      )
    bos = lookup("bos", BOS_FALLBACKS)
    pad = lookup("pad", PAD_FALLBACKS)
    bos, pad = eos if bos is None else bos, eos if pad is None else pad

    size = tok.get_vocab_size(with_added_tokens=True)
    if mask_token is not None:
      mask = _mask_from_string(mask_token, vocab)
    elif mask_id >= 0:
      mask = mask_id
    elif (named := lookup("mask")) is not None:  # a mask_token in tokenizer_config.json
      mask = named
    else:
      mask = next((vocab[c] for c in MASK_CANDIDATES if c in vocab), size)
    _check_mask(mask, model_vocab_size or max(size, mask + 1), eos=eos, bos=bos, pad=pad)
    return cls(
      tok, bos_id=bos, eos_id=eos, pad_id=pad, mask_id=mask, path=path, prepend_bos=prepend_bos
    )

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def encode_document(self, text: str) -> list[int]:
    """As `transformers`' tokenizer(text)["input_ids"], or BOS + encode(text) if prepend_bos."""
    if self.prepend_bos:
      return [self.bos_id, *self.encode(text)]
    return self.tokenizer.encode(text, add_special_tokens=True).ids

  def decode(self, ids: Iterable[int]) -> str:
    """Drops special ids (mask, bos, eos, pad, added specials) and ids past the vocabulary."""
    kept = [
      int(i) for i in ids if 0 <= int(i) < self.base_vocab_size and int(i) not in self._special_ids
    ]
    return self.tokenizer.decode(kept, skip_special_tokens=True)

  def token(self, token_id: int) -> str | None:
    return self.tokenizer.id_to_token(token_id)

  def __repr__(self) -> str:
    return (
      f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
      f"eos={self.eos_id}, pad={self.pad_id}, mask={self.mask_id})"
    )


def _mask_from_string(mask_token: str, vocab: dict[str, int]) -> int:
  if mask_token in vocab:
    return vocab[mask_token]
  if mask_token.isdigit():
    return int(mask_token)
  raise TokenizerError(
    f"mask token {mask_token!r} is not in the vocabulary (give a token "
    "string from tokenizer.json or a numeric id)"
  )


def _check_mask(mask: int, limit: int, **specials: int) -> None:
  """The mask id must be inside [0, limit) and differ from every special id."""
  if not 0 <= mask < limit:
    raise TokenizerError(
      f"mask id {mask} is outside the vocabulary [0, {limit}); pass "
      "--mask_token=<an unused special token>"
    )
  clashes = [role for role, i in specials.items() if i == mask]
  if clashes:
    raise TokenizerError(
      f"mask id {mask} equals the {'/'.join(clashes)} id; choose another mask token"
    )
