"""ByteTokenizer round trips, special ids and validate_special_ids."""

import dataclasses

import pytest

from sbd_jax.data.tokenizer import ByteTokenizer, Tokenizer, validate_special_ids


def test_round_trip_ascii_and_unicode():
  tok = ByteTokenizer()
  for text in ["", "Q: 12+7=19.\nA:", "naïve café ✓ 日本"]:
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_specials_are_distinct_and_skipped_by_decode():
  tok = ByteTokenizer()
  specials = [tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id]
  assert specials == [256, 257, 258, 259] and tok.vocab_size == 260
  ids = [tok.bos_id, *tok.encode("ab"), tok.mask_id, tok.eos_id, *tok.encode("c"), tok.pad_id]
  assert tok.decode(ids) == "abc"  # no stop at eos, specials dropped
  assert tok.encode("ab") == [97, 98]  # encode adds no specials


def test_satisfies_protocol():
  assert isinstance(ByteTokenizer(), Tokenizer)


@dataclasses.dataclass
class _Fake:
  vocab_size: int = 260
  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  mask_id: int = 259


def test_validate_special_ids_accepts_fitting_tokenizer():
  validate_special_ids(ByteTokenizer(), 260)
  validate_special_ids(ByteTokenizer(), 512)


@pytest.mark.parametrize(
  "fake, model_vocab, match",
  [
    (_Fake(), 259, "vocab_size"),
    (_Fake(vocab_size=100, mask_id=300), 260, "outside"),
    (_Fake(mask_id=-1), 260, "outside"),
    (_Fake(mask_id=258), 260, "eos"),
    (_Fake(mask_id=256), 260, "pad"),
    (_Fake(mask_id=257), 260, "bos"),
  ],
)
def test_validate_special_ids_rejects(fake, model_vocab, match):
  with pytest.raises(ValueError, match=match) as info:
    validate_special_ids(fake, model_vocab)
  assert "\n" not in str(info.value)
