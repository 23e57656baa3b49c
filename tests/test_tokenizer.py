"""Tokenizers: byte round trips, the word vocabulary built from a corpus, special-id checks."""

import dataclasses

import pytest

from sbd_jax import config as config_lib
from sbd_jax.data import arithmetic, vocab
from sbd_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_round_trip_ascii_and_unicode():
  tok = ByteTokenizer()
  for text in ["", "Q: 12+7=19.\nA:", "naïve café ✓ 日本"]:
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_specials_are_distinct_and_skipped_by_decode():
  tok = ByteTokenizer()
  specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id]
  assert specials == [256, 257, 258, 259] and tok.vocab_size == 260
  ids = [tok.bos_id, *tok.encode("ab"), tok.mask_id, tok.eos_id, *tok.encode("c"), tok.pad_id]
  assert tok.decode(ids) == "abc"  # no stop at eos, specials dropped
  assert tok.encode("ab") == [97, 98]  # encode adds no specials
  assert isinstance(tok, Tokenizer)


@pytest.fixture(scope="module")
def word_dir(tmp_path_factory):
  texts = [
    t
    for i in range(400)
    for style in arithmetic.SOLUTION_STYLES
    for t in (lambda p: (p.prompt, p.completion))(
      arithmetic.generate("train", i, seed=0, difficulty=arithmetic.Difficulty(solution=style))
    )
  ]
  # A rare string (one document) must not get an id of its own.
  texts.append("copy qzxv: qzxv.")
  return vocab.save(
    vocab.build_from_corpus(texts, vocab_size=512), str(tmp_path_factory.mktemp("w"))
  )


def test_word_vocabulary_pieces_digits_and_specials(word_dir):
  tok = HFTokenizer.from_path(word_dir)
  byte = ByteTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (
    byte.pad_id,
    byte.bos_id,
    byte.eos_id,
    byte.mask_id,
  )
  pieces = [tok.token(i) for i in tok.encode(" She has 34 + 187 = 221 apples.")]
  # A digit is one token whatever precedes it; the space before a number is its own token.
  assert pieces == [
    " She",
    " has",
    " ",
    "3",
    "4",
    " +",
    " ",
    "1",
    "8",
    "7",
    " =",
    " ",
    "2",
    "2",
    "1",
    " apples",
    ".",
  ]
  # Rare strings fall back to characters, then bytes: the same letters get the same ids in any
  # context (the space is a piece of its own in this vocabulary).
  assert tok.encode(" qzxv") == [tok.encode(" ")[0]] + [ord(c) for c in "qzxv"]
  assert tok.encode("qzxv") == [ord(c) for c in "qzxv"]
  assert tok.vocab_size <= 512


@pytest.mark.parametrize(
  "text", ["", "Q: Mia has 34 pens.\nA:", "naïve café ✓ 日本 \t\n  x", "The answer is -12."]
)
def test_word_vocabulary_round_trips_any_text(word_dir, text):
  tok = HFTokenizer.from_path(word_dir)
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id, *ids, tok.mask_id, tok.eos_id, tok.pad_id]) == text


@pytest.mark.parametrize("style, ratio", [("sentences", 0.45), ("columns", 0.55)])
def test_word_vocabulary_is_shorter_than_bytes(word_dir, style, ratio):
  """Words are single tokens; digits and signs (most of a column solution) stay one each."""
  tok = HFTokenizer.from_path(word_dir)
  problem = arithmetic.generate("eval", 3, seed=0, difficulty=arithmetic.Difficulty(solution=style))
  assert len(tok.encode(problem.text)) < ratio * len(ByteTokenizer().encode(problem.text))


def test_word_vocabulary_without_words_is_the_byte_tokenizer(tmp_path):
  tok = HFTokenizer.from_path(vocab.save(vocab.build_tokenizer([]), str(tmp_path)))
  text = "Q: naïve 12?\n"
  assert tok.encode(text) == ByteTokenizer().encode(text) and tok.vocab_size == 260


def test_load_tokenizer_words_needs_the_workdir_vocabulary(tmp_path, word_dir):
  with pytest.raises(FileNotFoundError, match="no word vocabulary"):
    load_tokenizer("words", str(tmp_path))
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)


@dataclasses.dataclass
class _Fake:
  vocab_size: int = 260
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  mask_id: int = 259


@pytest.mark.parametrize(
  "fake, model_vocab, match",
  [
    (_Fake(), 259, "larger than model.vocab_size"),
    (_Fake(vocab_size=100, mask_id=300), 260, "outside"),
    (_Fake(mask_id=258), 260, "eos"),
    (_Fake(mask_id=256), 260, "eos/bos/pad"),
  ],
)
def test_config_rejects_tokenizers_that_do_not_fit_the_model(fake, model_vocab, match):
  c = config_lib.base_config()
  c.model.vocab_size = model_vocab
  with pytest.raises(config_lib.ConfigError, match=match) as info:
    config_lib.validate(c, tokenizer=fake)
  assert "\n" not in str(info.value)
