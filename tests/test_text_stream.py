"""`serving.text_stream`: the text a choice sends, detokenized incrementally, equals the whole
text decoded at once (cut at the first stop string), for byte, byte-level BPE and
SentencePiece-style (a leading space per word) tokenizers, however the tokens are chunked; the
tokens' texts and offsets spell what was sent; and a response costs decoding linear in its
length."""

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.serving.requests import Tokens
from sbd_jax.serving.text_stream import TextStream


class Decoder:
  """A `tokenizers.Tokenizer` as the server's tokenizers decode, counting the ids decoded."""

  def __init__(self, tok):
    self.tok, self.decoded = tok, 0

  def decode(self, ids):
    ids = list(ids)
    self.decoded += len(ids)
    return self.tok.decode(ids, skip_special_tokens=True)


class CountingBytes(ByteTokenizer):
  decoded = 0

  def decode(self, ids):
    ids = list(ids)
    self.decoded += len(ids)
    return super().decode(ids)


def byte_level_bpe():
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tok.decoder = decoders.ByteLevel()
  return Decoder(tok), len(alphabet)


def sentencepiece_style():
  """Words that start with "▁" (a space, dropped at the start of a text) and pieces that
  continue a word, as SentencePiece vocabularies are; decoded by the Metaspace decoder."""
  pieces = ["▁the", "▁cat", "▁sat", "s", "ing", "▁on", "▁mat", "▁", "é", ".", "▁STOP", "▁end"]
  tok = tokenizers.Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, "▁"))
  tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
  return Decoder(tok), len(pieces)


TOKENIZERS = {
  "bytes": lambda: (CountingBytes(), 256),
  "byte_level_bpe": byte_level_bpe,
  "sentencepiece": sentencepiece_style,
}


def byte_chars():
  """GPT-2's map of bytes to the printable characters of the ByteLevel alphabet."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
  printable += range(ord("®"), ord("ÿ") + 1)
  others = [b for b in range(256) if b not in printable]
  return {
    **{b: chr(b) for b in printable},
    **{b: chr(256 + i) for i, b in enumerate(others)},
  }


def random_ids(rng, vocab, n, tokenizer_name):
  if tokenizer_name == "sentencepiece":
    return [int(i) for i in rng.integers(0, vocab, n)]
  # UTF-8 text (multi-byte characters split across tokens), as bytes, with a stray bad byte.
  text = "".join(rng.choice(list("ab €é漢 STOP\n")) for _ in range(n))
  data = list(text.encode())[:n]
  data[len(data) // 2] = 0xFF
  if tokenizer_name == "byte_level_bpe":  # the alphabet's id of each byte
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    chars = byte_chars()
    return [alphabet.index(chars[b]) for b in data]
  return data


def chunks(rng, ids):
  out, i = [], 0
  while i < len(ids):
    k = int(rng.integers(1, 6))
    out.append(ids[i : i + k])
    i += k
  return out


def stream(tokenizer, ids_chunks, stops):
  s = TextStream(tokenizer, stops)
  sent, reported = "", []
  for piece in ids_chunks:
    sent += s.add(Tokens(piece, [float(x) for x in piece]))
    reported += s.take_sent()
    if s.stopped:
      break
  sent += s.finish()
  reported += s.take_sent()
  return s, sent, reported


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("seed", range(4))
def test_the_streamed_text_is_the_whole_decode_cut_at_the_first_stop(name, seed):
  rng = np.random.default_rng(seed)
  tokenizer, vocab = TOKENIZERS[name]()
  ids = random_ids(rng, vocab, 60, name)
  whole = tokenizer.decode(ids)

  s, sent, reported = stream(tokenizer, chunks(rng, ids), [])
  assert sent == whole and not s.stopped and s.kept_tokens is None
  assert len(reported) == len(ids)  # every token, with its log-probability, in order
  assert [lp for _, lp, _ in reported] == [float(x) for x in ids]
  assert "".join(text for text, _, _ in reported) == whole
  offsets = np.cumsum([0] + [len(text) for text, _, _ in reported])[:-1]
  assert [offset for _, _, offset in reported] == list(offsets)

  # A stop string of real characters (a replacement character is final only once the next
  # token shows that the bytes before it never complete a character).
  mid = next(i for i in range(len(whole) // 2, len(whole)) if "\ufffd" not in whole[i : i + 2])
  stop = "STOP" if "STOP" in whole else whole[mid : mid + 2]
  s, sent, reported = stream(tokenizer, chunks(rng, ids), [stop, "never"])
  at = whole.index(stop)
  assert s.stopped and sent == whole[:at]
  # The tokens kept: the fewest whose text holds the whole stop string.
  kept = next(n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n])[at:].startswith(stop))
  assert s.kept_tokens == kept
  assert "".join(text for text, _, _ in reported) == sent[: len("".join(t for t, _, _ in reported))]
  assert all(offset + len(text) <= len(sent) for text, _, offset in reported)


@pytest.mark.parametrize("chunk", [1, 16])
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_response_costs_decoding_linear_in_its_length(name, chunk):
  """Streamed a token (NTP) or a block (SBD) at a time, n tokens decode O(n) ids in all, not the
  O(n^2) of decoding the whole text at each chunk."""
  rng = np.random.default_rng(0)
  tokenizer, vocab = TOKENIZERS[name]()
  ids = random_ids(rng, vocab, 600, name)
  s = TextStream(tokenizer, ["never"])
  for i in range(0, len(ids), chunk):
    s.add(ids[i : i + chunk])
  s.finish()
  decoded = tokenizer.decoded
  assert s.sent == tokenizer.decode(ids)
  assert decoded < 12 * len(ids)
