"""A word-level vocabulary with byte fallback, built from a training corpus (for small models).

The pre-tokenizer cuts text into pieces: a word with its leading space (" apples"), a single
digit with no space attached (so a digit is the same token wherever it stands and every
number is a sequence of them), a single punctuation mark, or a run of whitespace. Pieces that occur in at least `min_doc_fraction` of the corpus's documents get an id
of their own; every other piece falls back to its UTF-8 bytes, so any text round-trips exactly
and rare strings (names, random letters) are spelled the same way wherever they occur.

Ids follow `ByteTokenizer`: bytes 0..255 (tokens "<0x00>".."<0xFF>"), pad 256, bos 257, eos 258,
mask 259, then words from 260. With no words the result is the byte tokenizer written as a
`tokenizer.json`. The vocabulary is an ordinary `tokenizers` BPE model (no merges, whole pieces
looked up first, byte fallback), so `HFTokenizer` and `transformers` load it as is.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable

from etils import epath

from sbd_jax.data.tokenizer import TOKENIZER_FILE, ByteTokenizer

PIECES = r" ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]|\s+"
SPECIALS = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "mask": "<mask>"}
NUM_BASE_IDS = 260  # 256 bytes + 4 specials, as in ByteTokenizer


def _pre_tokenizer():
  from tokenizers import Regex, pre_tokenizers

  return pre_tokenizers.Split(Regex(PIECES), behavior="isolated")


def count_pieces(texts: Iterable[str]) -> tuple[collections.Counter, int]:
  """(document frequency of every piece, number of documents)."""
  pre = _pre_tokenizer()
  doc_freq: collections.Counter = collections.Counter()
  num_docs = 0
  for text in texts:
    doc_freq.update({piece for piece, _ in pre.pre_tokenize_str(text)})
    num_docs += 1
  return doc_freq, num_docs


def choose_words(
  doc_freq: collections.Counter, num_docs: int, max_words: int, min_doc_fraction: float
) -> list[str]:
  """The most frequent pieces at or above the document-frequency threshold (ties by piece)."""
  threshold = max(1.0, min_doc_fraction * num_docs)
  ranked = sorted(doc_freq.items(), key=lambda kv: (-kv[1], kv[0]))
  return [piece for piece, n in ranked if n >= threshold][:max_words]


def build_tokenizer(words: Iterable[str]):
  """A `tokenizers.Tokenizer` with the byte/special layout above and one id per word."""
  from tokenizers import AddedToken, Tokenizer, decoders, models

  byte = ByteTokenizer()
  vocab = {f"<0x{b:02X}>": b for b in range(256)}
  for role, token in SPECIALS.items():
    vocab[token] = getattr(byte, f"{role}_id")
  for word in words:
    vocab.setdefault(word, len(vocab))
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, ignore_merges=True))
  tok.pre_tokenizer = _pre_tokenizer()
  tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
  tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS.values()])
  return tok


def build_from_corpus(texts: Iterable[str], vocab_size: int, min_doc_fraction: float = 0.01):
  """A vocabulary of at most `vocab_size` ids for `texts` (the model's embedding rows)."""
  if vocab_size < NUM_BASE_IDS:
    raise ValueError(f"a word vocabulary needs vocab_size >= {NUM_BASE_IDS}, got {vocab_size}")
  doc_freq, num_docs = count_pieces(texts)
  return build_tokenizer(
    choose_words(doc_freq, num_docs, vocab_size - NUM_BASE_IDS, min_doc_fraction)
  )


def save(tokenizer, directory: str) -> str:
  """Write tokenizer.json and a tokenizer_config.json naming the specials (a local directory or
  one in a bucket); returns the dir."""
  folder = epath.Path(directory)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / TOKENIZER_FILE).write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
  sidecar = {f"{role}_token": token for role, token in SPECIALS.items()}
  sidecar["model_max_length"] = 1 << 20
  (folder / "tokenizer_config.json").write_text(json.dumps(sidecar, indent=2), encoding="utf-8")
  return directory


def corpus_texts(data_cfg, seed: int, max_docs: int) -> Iterable[str]:
  """Texts of the first `max_docs` training records (prompt and completion separately)."""
  from sbd_jax.data import sources

  bad = sources.BadRecords() if data_cfg.skip_bad_records else None
  source = sources.make_source(data_cfg, seed, bad)
  for index in range(min(len(source), max_docs)):
    record = source[index]
    if record is None:  # skipped (data.skip_bad_records)
      continue
    if "messages" in record:
      yield from (m["content"] for m in record["messages"])
    else:
      yield from (record["text"],) if "text" in record else (record["prompt"], record["completion"])


def ensure_in_workdir(
  workdir: str, data_cfg, seed: int, vocab_size: int, *, write: bool, max_docs: int = 20_000
):
  """The run's word vocabulary: loaded from <workdir>/tokenizer/, or built from the training
  data (deterministically, so every host builds the same one) and saved there by the writer."""
  from sbd_jax.data.tokenizer import WORKDIR_TOKENIZER_DIR, HFTokenizer

  directory = os.path.join(workdir, WORKDIR_TOKENIZER_DIR)
  if epath.Path(directory, TOKENIZER_FILE).is_file():
    return HFTokenizer.from_path(directory, prepend_bos=True)
  tok = build_from_corpus(corpus_texts(data_cfg, seed, max_docs), vocab_size)
  if write:
    save(tok, directory)
  byte = ByteTokenizer()
  return HFTokenizer(
    tok,
    bos_id=byte.bos_id,
    eos_id=byte.eos_id,
    pad_id=byte.pad_id,
    mask_id=byte.mask_id,
    path=directory,
    prepend_bos=True,
  )
