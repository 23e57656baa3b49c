"""Constraints compiled to token automata (sbd_jax.constrain), checked against independent
references: outlines-core's own index, python `re`, the `jsonschema` validator, and each
tokenizer's own decode and encode."""

import copy
import json
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from constrain_helpers import (  # tests/ is on sys.path
  CORPUS,
  assert_matches_index,
  bpe_tokenizer,
  regexes,
  schemas,
  synthetic_bpe,
  text_of,
  walk,
  word_tokenizer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from outlines_core import Index

from sbd_jax.constrain import device
from sbd_jax.constrain.automaton import Limits, compile_regex, token_ids
from sbd_jax.constrain.compiler import CompilerSettings, ConstraintCompiler
from sbd_jax.constrain.index import outlines_vocabulary
from sbd_jax.constrain.integers import range_regex
from sbd_jax.constrain.regexes import constraint_regex
from sbd_jax.constrain.spec import Constraint, ConstraintError
from sbd_jax.constrain.tables import DEAD, UNCONSTRAINED, bucket, pack
from sbd_jax.constrain.vocabulary import TokenVocabulary
from sbd_jax.data.tokenizer import ByteTokenizer, HFTokenizer

KINDS = ("byte", "words", "bpe")
PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "description": "annotations are dropped"},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "role": {"$ref": "#/$defs/role"},
    "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
  },
  "required": ["name", "age", "role"],
  "additionalProperties": False,
  "$defs": {"role": {"enum": ["admin", "user", 'a "quoted" \\ role', "日本"]}},
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  return {
    "byte": ByteTokenizer(),
    "words": word_tokenizer(str(tmp_path_factory.mktemp("words"))),
    "bpe": bpe_tokenizer(str(tmp_path_factory.mktemp("bpe"))),
  }


@pytest.fixture(scope="module")
def vocabularies(tokenizers):
  # The BPE's model has more logits than its tokenizer has ids (as Qwen-3's does).
  sizes = {"bpe": tokenizers["bpe"].vocab_size + 7}
  return {k: TokenVocabulary.from_tokenizer(t, sizes.get(k)) for k, t in tokenizers.items()}


def _compile(constraint, vocabulary, limits=None):
  return compile_regex(constraint_regex(constraint), vocabulary, limits or Limits())


def _walk_texts(constraint, vocabulary, seed, rows=8, budget=24):
  """(ids, text) of random walks through the packed device tables (one table shape for most
  constraints: one compiled walk), and the automaton; None where a walk could be too long."""
  automaton = _compile(constraint, vocabulary)
  packed = pack([automaton], vocabulary.vocab_size, vocabulary.mask_id, 2048, 4096)
  walks = walk(packed, [automaton], [packed.initial_states[0]] * rows, vocabulary, seed, budget)
  if walks is None:
    return None, automaton
  assert all(ended for _, ended in walks), "a walk did not reach EOS"
  return [(ids, text_of(ids, vocabulary).decode("utf-8")) for ids, _ in walks], automaton


def _accepts(automaton, ids, eos_id) -> bool:
  state = 0
  for token in [*ids, eos_id]:
    state = automaton.next_state(state, token)
    if state < 0:
      return False
  return automaton.is_final(state)


# --- the vocabulary adapter -------------------------------------------------------------------


def test_byte_vocabulary_is_the_bytes_and_excludes_specials():
  v = TokenVocabulary.from_tokenizer(ByteTokenizer(), vocab_size=270)
  assert v.token_bytes[:256] == tuple(bytes([b]) for b in range(256))
  assert v.token_bytes[256:] == (None,) * 14 and (v.eos_id, v.mask_id) == (258, 259)


@pytest.mark.parametrize("kind", ["words", "bpe"])
def test_token_bytes_are_what_the_tokenizer_decodes(tokenizers, vocabularies, kind):
  tok, v = tokenizers[kind], vocabularies[kind]
  special = {tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id}
  assert all(v.token_bytes[i] is None for i in special)
  assert all(t is None for t in v.token_bytes[tok.base_vocab_size :])
  checked = 0
  for i, data in enumerate(v.token_bytes):
    if data is not None and b"\xef\xbf\xbd" not in data:
      try:
        text = data.decode("utf-8")
      except UnicodeDecodeError:
        continue  # part of a character: checked through encode below
      assert tok.decode([i]) == text, (i, tok.token(i))
      checked += 1
  assert checked > 0.6 * sum(t is not None for t in v.token_bytes)
  for text in [*CORPUS, "zq ✓ 日本 <think> \x01\t\n"]:
    assert text_of(tok.encode(text), v) == text.encode("utf-8")


def test_added_non_special_token_and_partial_characters_in_the_bpe(tokenizers, vocabularies):
  tok, v = tokenizers["bpe"], vocabularies["bpe"]
  think = tok.tokenizer.token_to_id("<think>")
  assert v.token_bytes[think] == b"<think>"
  assert any(t is not None and len(t) == 1 and t[0] >= 0x80 for t in v.token_bytes)
  endoftext = tok.tokenizer.token_to_id("<|endoftext|>")
  assert v.token_bytes[endoftext] is None and tok.mask_id >= tok.base_vocab_size


def test_unsupported_decoders_and_sizes_are_refused(tokenizers):
  from tokenizers import decoders

  inner = copy.deepcopy(tokenizers["bpe"].tokenizer)
  tok = HFTokenizer(inner, bos_id=0, eos_id=2, pad_id=0, mask_id=inner.get_vocab_size())
  tok.tokenizer.decoder = decoders.Metaspace()
  with pytest.raises(ConstraintError, match="decoder Metaspace is not supported"):
    TokenVocabulary.from_tokenizer(tok)
  with pytest.raises(ConstraintError, match="below the tokenizer's 260"):
    TokenVocabulary.from_tokenizer(ByteTokenizer(), vocab_size=259)


def test_fingerprint_names_the_contents():
  a = TokenVocabulary.from_tokenizer(ByteTokenizer())
  assert a.fingerprint == TokenVocabulary.from_tokenizer(ByteTokenizer()).fingerprint
  assert a.fingerprint != TokenVocabulary.from_tokenizer(ByteTokenizer(), 264).fingerprint
  other = list(a.token_bytes)
  other[7] = None
  assert TokenVocabulary(tuple(other), 258, 259).fingerprint != a.fingerprint


# --- the automaton is outlines-core's index -----------------------------------------------------

INDEX_CASES = [
  Constraint.regex(r"(?:ab|a)+c?[0-9]{1,3}"),
  Constraint.regex("é|日本|[x-z]*"),
  Constraint.choice(["yes", "no", "maybe so", "日本"]),
  Constraint.json_schema(PERSON),
  Constraint.json_object(0),
]


@pytest.mark.parametrize("kind", KINDS)
def test_device_tables_are_outlines_cores_index(vocabularies, kind):
  v = vocabularies[kind]
  automata = [_compile(c, v) for c in INDEX_CASES]
  packed = pack(automata, v.vocab_size, v.mask_id)
  for constraint, automaton, offset in zip(INDEX_CASES, automata, packed.initial_states):
    # The regex with its end marker; the marker's token is id V (`constrain.index`).
    regex = f"(?:{constraint_regex(constraint)})\\x{{10FFFF}}"
    index = Index(regex, outlines_vocabulary(v))
    paired = assert_matches_index(packed, offset, index, v.vocab_size, v.eos_id)
    assert paired == automaton.num_states


@pytest.mark.parametrize("kind", KINDS)
def test_host_api_masks_and_forced_tokens_agree_with_the_tables(vocabularies, kind):
  v = vocabularies[kind]
  automata = [_compile(c, v) for c in INDEX_CASES]
  packed = pack(automata, v.vocab_size, v.mask_id)
  tables = jax.tree.map(jnp.asarray, packed.tables)
  for automaton, offset in zip(automata, packed.initial_states):
    local_A = np.arange(automaton.num_states)
    allowed_AV = np.asarray(
      device.allowed_mask(tables, jnp.asarray(local_A + offset), v.vocab_size)
    )
    forced_A = np.asarray(device.forced_token(tables, jnp.asarray(local_A + offset)))
    for s in local_A:
      allowed = automaton.allowed_tokens(s)
      assert np.array_equal(np.flatnonzero(allowed_AV[s]), allowed)
      single = len(allowed) == 1 and allowed[0] != v.eos_id
      assert forced_A[s] == automaton.forced_token(s) == (allowed[0] if single else -1)
      assert automaton.is_final(s) == (v.eos_id in allowed)
      assert v.mask_id not in allowed and all(
        v.token_bytes[t] is not None for t in allowed if t != v.eos_id
      )
  # An object starts with "{": forced where one token alone spells what may come first.
  first = automata[3].allowed_tokens(0)
  assert all(v.token_bytes[t].startswith(b"{") for t in first)
  assert automata[3].forced_token(0) == (first[0] if len(first) == 1 else -1)


def test_packed_bitmasks_round_trip():
  rng = np.random.default_rng(0)
  for vocab_size in (1, 31, 32, 33, 260, 1000):
    allowed_AV = rng.random((5, vocab_size)) < 0.3
    padded = np.pad(allowed_AV, ((0, 0), (0, -vocab_size % 32)))
    words_AU = np.packbits(padded, axis=1, bitorder="little").view("<u4")
    for s in range(5):
      assert np.array_equal(token_ids(words_AU[s], vocab_size), np.flatnonzero(allowed_AV[s]))
    # Bit t % 32 of word t // 32, as the device reads it.
    t = rng.integers(vocab_size, size=20)
    assert np.array_equal((words_AU[0, t >> 5] >> (t & 31)) & 1, allowed_AV[0, t])


def test_states_no_complete_text_can_leave_are_dropped():
  """A vocabulary without "c": outlines-core keeps the (ab)* loop; no final state is reachable
  from it, so the automaton drops it."""
  spellable = {b"a": 0, b"b": 1, b"x": 2, b"ab": 3}
  v = TokenVocabulary(tuple([*spellable, None, None]), eos_id=4, mask_id=5)
  automaton = compile_regex("(ab)*c|x", v)
  index = Index("(?:(ab)*c|x)\\x{10FFFF}", outlines_vocabulary(v))
  assert set(index.get_allowed_tokens(index.get_initial_state())) == {0, 2, 3}
  assert automaton.allowed_tokens(0).tolist() == [2] and automaton.num_states == 2
  with pytest.raises(ConstraintError, match="admits no complete text"):
    compile_regex("(ab)*c", v)


# --- random walks produce what the constraint allows -----------------------------------------


def _probes(texts, draw_rng):
  """The walks' texts, each shortened, lengthened and changed by one character, and random
  strings of the regexes' alphabet."""
  alphabet = 'abc07 é日.{"-,xA\n'
  out = list(texts)
  for text in texts:
    c = alphabet[draw_rng.integers(len(alphabet))]
    out += [text[:-1], text + c, c + text, text[:1] + c + text[2:]]
  out += ["".join(draw_rng.choice(list(alphabet), draw_rng.integers(0, 6))) for _ in range(6)]
  return out


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(pattern=regexes(), seed=st.integers(0, 2**16))
def test_walks_match_random_regexes_and_acceptance_is_pythons_fullmatch(
  tokenizers, vocabularies, kind, pattern, seed
):
  tok, v = tokenizers[kind], vocabularies[kind]
  walks, automaton = _walk_texts(Constraint.regex(pattern), v, seed)
  if walks is None:
    return
  for ids, text in walks:
    assert re.fullmatch(pattern, text), (pattern, text)
    assert tok.decode(ids) == text
  for text in _probes([t for _, t in walks], np.random.default_rng(seed)):
    expected = re.fullmatch(pattern, text) is not None
    assert _accepts(automaton, tok.encode(text), v.eos_id) == expected, (pattern, text)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas(), seed=st.integers(0, 2**16))
def test_walks_validate_against_random_json_schemas(tokenizers, vocabularies, kind, schema, seed):
  tok, v = tokenizers[kind], vocabularies[kind]
  walks, automaton = _walk_texts(Constraint.json_schema(schema), v, seed, budget=16)
  if walks is None:
    return
  validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
  for ids, text in walks:
    validator.validate(json.loads(text))
    assert tok.decode(ids) == text
    assert _accepts(automaton, tok.encode(text), v.eos_id)  # the tokenizer's own spelling too


JSON_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")


@settings(max_examples=300, deadline=None)
@given(
  low=st.none() | st.integers(-(10**7), 10**7),
  high=st.none() | st.integers(-(10**7), 10**7),
  probes=st.lists(st.integers(-(10**8), 10**8), max_size=40),
)
def test_an_integer_range_regex_matches_exactly_the_integers_in_it(low, high, probes):
  """Against arithmetic: every integer near the bounds, at powers of ten and drawn at random
  is matched exactly when it is in the range; nothing else JSON would not write as that
  integer ("-0", leading zeros, a sign, a fraction) ever is."""
  if low is not None and high is not None and low > high:
    with pytest.raises(ValueError, match="no integer"):
      range_regex(low, high)
    return
  pattern = re.compile(range_regex(low, high))
  bounds = [b for b in (low, high) if b is not None]
  near = {b + d for b in bounds for d in range(-12, 13)}
  tens = {sign * 10**k + d for k in range(9) for d in (-1, 0, 1) for sign in (1, -1)}
  for n in near | tens | set(probes) | set(range(-120, 121)):
    inside = (low is None or n >= low) and (high is None or n <= high)
    assert bool(pattern.fullmatch(str(n))) == inside, (low, high, n, pattern.pattern)
  for text in ("-0", "00", "01", "-01", "+1", "1.0", "1e2", "", "-", " 1"):
    assert not pattern.fullmatch(text) or JSON_INTEGER.fullmatch(text) and text != "-0"


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_integer_bounds_admit_exactly_the_integers_they_allow(tokenizers, vocabularies, kind):
  """A schema's integer bounds (inclusive, exclusive, fractional, one-sided, in nested
  values): the automaton accepts a document exactly where `jsonschema` validates it."""
  tok, v = tokenizers[kind], vocabularies[kind]
  schema = {
    "type": "object",
    "properties": {
      "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "t": {"type": "array", "items": {"type": "integer", "exclusiveMinimum": -3.5,
                                       "exclusiveMaximum": 1000}},
      "n": {"anyOf": [{"type": "integer", "minimum": 12}, {"type": "null"}]},
    },
    "required": ["age", "t", "n"],
    "additionalProperties": False,
  }  # fmt: skip
  automaton = _compile(Constraint.json_schema(schema), v)
  validator = jsonschema.Draft202012Validator(schema)
  values = [-151, -4, -3, -1, 0, 1, 9, 11, 12, 99, 100, 149, 150, 151, 999, 1000, 10**6]
  rng = np.random.default_rng(0)
  for _ in range(150):
    age, t, n = (int(x) for x in rng.choice(values, 3))
    doc = {"age": age, "t": [t, int(rng.choice(values))], "n": None if n == 1 else n}
    text = json.dumps(doc, separators=(",", ":"))
    assert _accepts(automaton, tok.encode(text), v.eos_id) == validator.is_valid(doc), text
  assert not _accepts(automaton, tok.encode('{"age":01,"t":[],"n":null}'), v.eos_id)
  assert not _accepts(automaton, tok.encode('{"age":-0,"t":[],"n":null}'), v.eos_id)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [0, 1])
def test_json_object_walks_are_objects_nested_at_most_depth(vocabularies, kind, depth):
  def nesting(value):
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return 1 + max(map(nesting, inner), default=0) if isinstance(value, dict | list) else 0

  walks, _ = _walk_texts(Constraint.json_object(depth), vocabularies[kind], seed=depth)
  values = [json.loads(text) for _, text in walks]
  assert all(isinstance(x, dict) for x in values)
  assert max(nesting(x) for x in values) <= depth + 1


@pytest.mark.parametrize("kind", KINDS)
def test_choices_are_exactly_the_strings(tokenizers, vocabularies, kind):
  tok, v = tokenizers[kind], vocabularies[kind]
  options = ["yes", "no", "yes!", "日本", 'a "q" | .*', ""]
  walks, automaton = _walk_texts(Constraint.choice(options), v, seed=3)
  assert {text for _, text in walks} <= set(options)
  assert len({text for _, text in walks}) >= 3  # the walks are random, not one path
  for text in options:
    assert _accepts(automaton, tok.encode(text), v.eos_id)
  for text in ["ye", "yes!!", "no ", "日", "Yes"]:
    assert not _accepts(automaton, tok.encode(text), v.eos_id)


def test_transitions_after_a_point_where_the_regex_could_end_are_kept(vocabularies):
  """outlines-core 0.2.14's own index drops these (`constrain.index`); python re decides."""
  v = vocabularies["byte"]
  for pattern, texts in [("a(bc)?", ["a", "abc"]), (r"[0-9]+(\.[0-9]+)?", ["1", "1.5", "10.25"]),
                         ("a(?:é)?", ["a", "aé"]), ("(ac|[^a])+", ["acac", "bac"])]:  # fmt: skip
    automaton = _compile(Constraint.regex(pattern), v)
    for text in texts:
      assert re.fullmatch(pattern, text) and _accepts(automaton, list(text.encode()), v.eos_id)


# --- one table set for a batch ------------------------------------------------------------------

MIXED = [
  Constraint.regex("[a-c]{2,4}"),
  Constraint.choice(["yes", "no"]),
  Constraint.json_schema(PERSON),
  Constraint.regex("(?:x|日)+"),
]


def _check_mixed(constraint, text):
  if constraint.kind == "choice":
    return text in constraint.choices()
  if constraint.kind == "regex":
    return re.fullmatch(constraint.source, text) is not None
  jsonschema.validate(json.loads(text), constraint.schema())
  return True


@pytest.mark.parametrize("kind", KINDS)
def test_constraints_packed_together_keep_their_own_languages(tokenizers, vocabularies, kind):
  v = vocabularies[kind]
  automata = [_compile(c, v) for c in MIXED]
  packed = pack(automata, v.vocab_size, v.mask_id, 2048, 4096)  # the shape other walks have
  alone = [pack([a], v.vocab_size, v.mask_id) for a in automata]
  # Rows of every constraint, and rows without one, in one batch.
  rows = [0, 1, 2, 3, None, 2, 1, 0]
  initial_B = [UNCONSTRAINED if r is None else packed.initial_states[r] for r in rows]
  walks = walk(packed, automata, initial_B, v, seed=7, budget=12)
  for r, (ids, ended) in zip(rows, walks):
    if r is not None:
      assert ended and _check_mixed(MIXED[r], text_of(ids, v).decode("utf-8"))
  # Each automaton's rows of the shared tables are its tables alone, shifted by its offset.
  for automaton, offset, single in zip(automata, packed.initial_states, alone):
    a, o1 = automaton.num_states, single.initial_states[0]
    t, t1 = packed.tables, single.tables
    assert np.array_equal(t.allowed_AU[offset : offset + a], t1.allowed_AU[o1 : o1 + a])
    assert np.array_equal(t.default_A[offset : offset + a] - offset, t1.default_A[o1 : o1 + a] - o1)
    assert np.array_equal(t.final_A[offset : offset + a], t1.final_A[o1 : o1 + a])
    assert np.array_equal(t.forced_A[offset : offset + a], t1.forced_A[o1 : o1 + a])


def test_unconstrained_and_dead_states(vocabularies):
  v = vocabularies["bpe"]
  packed = pack([_compile(MIXED[0], v)], v.vocab_size, v.mask_id)
  tables = jax.tree.map(jnp.asarray, packed.tables)
  logits_BTV = jax.random.normal(jax.random.key(0), (1, 2, v.vocab_size))
  masked = np.asarray(device.mask_logits(tables, logits_BTV, jnp.array([[UNCONSTRAINED, DEAD]])))
  free = np.isfinite(masked[0, 0])
  assert not free[v.mask_id] and free.sum() == v.vocab_size - 1
  assert np.array_equal(masked[0, 0][free], np.asarray(logits_BTV)[0, 0][free])
  assert np.isneginf(masked[0, 1]).all()
  token_V = jnp.arange(v.vocab_size)
  after_V = np.asarray(device.next_state(tables, jnp.zeros(v.vocab_size, jnp.int32), token_V))
  assert (after_V[free] == UNCONSTRAINED).all() and after_V[v.mask_id] == DEAD
  assert (
    np.asarray(device.next_state(tables, jnp.ones(v.vocab_size, jnp.int32), token_V)) == DEAD
  ).all()
  final, forced = (
    device.is_final(tables, jnp.array([0, 1])),
    device.forced_token(tables, jnp.array([0, 1])),
  )
  assert np.asarray(final).tolist() == [True, False] and np.asarray(forced).tolist() == [-1, -1]
  outside = device.next_state(
    tables, jnp.array([0, 0]), jnp.array([-1, 32 * tables.allowed_AU.shape[1]])
  )
  assert np.asarray(outside).tolist() == [DEAD, DEAD]


def test_advance_is_next_state_token_by_token_and_dead_stays(tokenizers, vocabularies):
  tok, v = tokenizers["words"], vocabularies["words"]
  automaton = _compile(MIXED[0], v)
  packed = pack([automaton], v.vocab_size, v.mask_id)
  tables = jax.tree.map(jnp.asarray, packed.tables)
  o = packed.initial_states[0]
  good, bad = tok.encode("abca"), tok.encode("abxa")
  tokens_BT = jnp.array([good, bad, good], jnp.int32)
  state_B = jnp.array([o, o, UNCONSTRAINED])
  after_BT = np.asarray(jax.jit(device.advance)(tables, state_B, tokens_BT))
  state = 0
  for t, token in enumerate(good):
    state = automaton.next_state(state, token)
    assert after_BT[0, t] == state + o
  assert automaton.is_final(state) and bool(device.is_final(tables, after_BT[0, -1]))
  assert after_BT[1, 1] != DEAD and (after_BT[1, 2:] == DEAD).all()
  assert (after_BT[2] == UNCONSTRAINED).all()
  before_BT = np.asarray(device.states_before(state_B, jnp.asarray(after_BT)))
  assert before_BT[:, 0].tolist() == [o, o, 0] and np.array_equal(
    before_BT[:, 1:], after_BT[:, :-1]
  )


def test_tables_are_padded_to_buckets(vocabularies):
  assert [bucket(n, 8) for n in (1, 8, 9, 12, 13, 17, 25, 100)] == [8, 8, 12, 12, 16, 24, 32, 128]
  v = vocabularies["byte"]
  small, larger = (
    _compile(Constraint.regex("[a-c]{6}"), v),
    _compile(Constraint.regex("[a-c]{8}"), v),
  )
  shapes = [[x.shape for x in pack([a], v.vocab_size, v.mask_id).tables] for a in (small, larger)]
  assert shapes[0] == shapes[1]  # 9 and 11 states with the 2 reserved: both in the 12 bucket
  padded = pack([small], v.vocab_size, v.mask_id)
  a = padded.num_states
  assert not padded.tables.allowed_AU[a:].any() and not padded.tables.final_A[a:].any()
  assert (padded.tables.default_A[a:] == DEAD).all() and (padded.tables.forced_A[a:] == -1).all()


# --- compiling: bounds, refusals, the cache -----------------------------------------------------

HOSTILE = "(a|b)*a(a|b){24}"  # a DFA of 2^25 states


def test_a_constraint_too_slow_to_compile_is_refused_in_one_line_within_the_bound():
  v = TokenVocabulary.from_tokenizer(ByteTokenizer())
  with ConstraintCompiler(CompilerSettings(timeout_s=1.5, worker_memory_bytes=2 << 30)) as c:
    c.compile(Constraint.regex("a"), v)  # the worker started and holds the vocabulary
    start = time.monotonic()
    with pytest.raises(ConstraintError, match=r"too large: not compiled within 1.5 s") as e:
      c.compile(Constraint.regex(HOSTILE), v)
    assert time.monotonic() - start < 1.5 + 2.0 and "\n" not in str(e.value)
    start = time.monotonic()
    with pytest.raises(ConstraintError, match="not compiled within"):
      c.compile(Constraint.regex(HOSTILE), v)  # the refusal is cached: no second wait
    assert time.monotonic() - start < 0.1
    assert c.compile(Constraint.regex("[0-9]+"), v).num_states == 2  # a fresh worker


def test_a_worker_that_fails_is_a_runtime_error_never_cached_as_a_refusal():
  v = TokenVocabulary.from_tokenizer(ByteTokenizer())
  with ConstraintCompiler(CompilerSettings(worker_memory_bytes=30 << 20)) as c:
    for _ in range(2):  # tried again: nothing was cached
      with pytest.raises(RuntimeError, match="worker failed") as e:
        c.compile(Constraint.regex("a+"), v)
      assert "\n" not in str(e.value) and not isinstance(e.value, ConstraintError)


def test_the_worker_and_the_compiler_import_no_jax():
  code = (
    "import sys, sbd_jax.constrain.compiler, sbd_jax.constrain.worker; print('jax' in sys.modules)"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert done.stdout.strip() == "False"


def test_a_constraint_too_large_for_the_workers_memory_is_refused_in_one_line():
  v = TokenVocabulary.from_tokenizer(ByteTokenizer())
  with ConstraintCompiler(CompilerSettings(timeout_s=60, worker_memory_bytes=400 << 20)) as c:
    start = time.monotonic()
    with pytest.raises(ConstraintError, match=r"too large: its compiler died .*memory") as e:
      c.compile(Constraint.regex(HOSTILE), v)
    assert time.monotonic() - start < 30 and "\n" not in str(e.value)


@pytest.mark.parametrize(
  "limits, match",
  [(Limits(max_states=100), "states"), (Limits(max_table_bytes=2000), "table bytes")],
)
def test_states_and_table_bytes_are_bounded(limits, match):
  v = TokenVocabulary.from_tokenizer(ByteTokenizer())
  with pytest.raises(ConstraintError, match=f"too large: .*{match}") as e:
    _compile(Constraint.regex("[a-z]{300}"), v, limits)
  assert "\n" not in str(e.value)
  assert _compile(Constraint.regex("[a-z]{20}"), v, Limits(max_states=100)).num_states == 21


def test_the_cache_returns_the_same_automaton_and_evicts_the_least_recently_used():
  byte = TokenVocabulary.from_tokenizer(ByteTokenizer())
  wider = TokenVocabulary.from_tokenizer(ByteTokenizer(), vocab_size=300)
  a, b, c3 = (Constraint.regex(p) for p in ("a+", "b+", "c+"))
  with ConstraintCompiler(CompilerSettings(cache_entries=2)) as compiler:
    first = compiler.compile(a, byte)
    assert compiler.compile(Constraint.regex("a+"), byte) is first  # equal constraints hit
    assert compiler.submit(a, byte).result() is first
    assert compiler.compile(a, wider) is not first and compiler.compile(a, wider).vocab_size == 300
    compiler.compile(b, byte)  # evicts (a, byte), the least recently used
    compiler.compile(c3, byte)
    assert compiler.compile(a, byte) is not first
    assert (compiler.hits, compiler.misses) == (3, 5)
    with pytest.raises(ConstraintError, match="does not compile"):
      compiler.submit(Constraint.regex("(?=a)b"), byte).result()
    # More vocabularies than the worker keeps: the first is sent again when it is needed.
    for size in range(261, 261 + 5):
      compiler.compile(a, TokenVocabulary.from_tokenizer(ByteTokenizer(), vocab_size=size))
    assert compiler.compile(Constraint.regex("d+"), byte).allowed_tokens(0).tolist() == [100]


def _nested(levels):
  schema = {"type": "integer"}
  for _ in range(levels):
    schema = {"type": "array", "items": schema}
  return schema


def _fan_out(levels):
  """Each definition refers to the one before twice: 2^levels nodes once inlined."""
  defs = {"d0": {"type": "null"}}
  for i in range(1, levels + 1):
    defs[f"d{i}"] = {"prefixItems": [{"$ref": f"#/$defs/d{i - 1}"}] * 2}
  return {"$defs": defs, "$ref": f"#/$defs/d{levels}"}


INVALID = [
  (lambda: Constraint.regex("(?=a)b"), "does not compile"),
  (lambda: Constraint.regex("a(b"), "unbalanced"),
  (lambda: Constraint.regex("a$|b"), r"'\$' before its end"),
  (lambda: Constraint.regex("(?x)a # )"), "verbose"),
  (lambda: Constraint.regex(r"\bfoo"), "does not compile"),
  (lambda: Constraint.choice([]), "non-empty list"),
  (lambda: Constraint.choice("yes"), "list of strings"),
  (lambda: Constraint.json_object(4), "depth"),
  (lambda: Constraint.json_schema("{nope"), "not valid JSON"),
  (lambda: Constraint.json_schema([1]), "must be an object"),
  (
    lambda: Constraint.json_schema({"type": "number", "minimum": 3}),
    "minimum / maximum at # are supported on type 'integer' alone",
  ),
  (
    lambda: Constraint.json_schema({"properties": {"a": {"type": "integer", "multipleOf": 2}}}),
    "'multipleOf' at #/properties/a",
  ),
  (lambda: Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 4.5}), "no integer"),
  (lambda: Constraint.json_schema({"type": "integer", "exclusiveMinimum": True}), "a number"),
  (lambda: Constraint.json_schema({"type": "integer", "maximum": 2.0**70}), "64-bit"),
  (lambda: Constraint.json_schema({"type": "array", "uniqueItems": True}), "'uniqueItems'"),
  (lambda: Constraint.json_schema({"properties": {"a": {"not": {}}}}), "'not' at #/properties/a"),
  (lambda: Constraint.json_schema({"type": "strung"}), "'strung' at # is not a JSON-schema type"),
  (lambda: Constraint.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}), "oneOf"),
  (lambda: Constraint.json_schema({"allOf": [{"type": "integer"}, {}]}), "allOf"),
  (lambda: Constraint.json_schema({"$ref": "#/$defs/x"}), "names nothing"),
  (
    lambda: Constraint.json_schema(
      {"$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "$ref": "#/$defs/n"}
    ),
    "recursive",
  ),  # fmt: skip
  (lambda: Constraint.json_schema({"$ref": "http://example.com/s.json"}), "not a local reference"),
  (lambda: Constraint.json_schema({"type": "string", "format": "date-time"}), "format 'date-time'"),
  (lambda: Constraint.json_schema({"type": "string", "pattern": "[^a]+"}), "must escape"),
  (lambda: Constraint.json_schema({"type": "string", "pattern": "a", "maxLength": 3}), "together"),
  (
    lambda: Constraint.json_schema({"type": "string", "minLength": 3, "maxLength": 2}),
    "minLength > maxLength",
  ),
  (lambda: Constraint.json_schema({"properties": {"a": {}}, "required": ["b"]}), "'b'"),
  (lambda: Constraint.json_schema({"properties": {'q"': {}}}), "JSON escapes"),
  (lambda: Constraint.json_schema({"enum": [{"a.b": 1}]}), "object key 'a.b'"),
  (lambda: Constraint.json_schema({"const": 2**70}), "64-bit"),
  (lambda: Constraint.json_schema({"enum": [1.3581468794143987e-39]}), "more digits"),
  (lambda: Constraint.json_schema({"type": "object", "minProperties": 2}), "minProperties"),
  (lambda: Constraint.json_schema({"type": "integer", "enum": ["x"]}), "not of its type"),
  (lambda: Constraint.json_schema({"properties": {"a": False}}), "false: it admits no value"),
  (lambda: Constraint.json_schema({"type": "number", "maximum": float("nan")}), "JSON"),
  (lambda: Constraint.json_schema("[" * 100_000 + "]" * 100_000), "nested too deeply"),
  (lambda: Constraint.json_schema(_nested(100)), "too large: over .* 64 levels"),
  (lambda: Constraint.json_schema(_fan_out(30)), "too large: over 20000 nodes"),
]


@pytest.mark.parametrize("make, message", INVALID)
def test_invalid_and_unsupported_constraints_are_refused_in_one_line(make, message):
  v = TokenVocabulary.from_tokenizer(ByteTokenizer())
  with pytest.raises(ConstraintError, match=message) as e:
    _compile(make(), v)
  assert "\n" not in str(e.value) and len(str(e.value)) <= 300


def test_a_regex_no_token_can_spell_is_refused():
  v = TokenVocabulary((b"a", b"b", None, None), eos_id=2, mask_id=3)
  with pytest.raises(ConstraintError, match="admits no"):
    compile_regex("c+", v)


# --- a 128k vocabulary --------------------------------------------------------------------------


def test_tables_for_a_128k_vocabulary_are_16_kib_a_state():
  """Llama-3's vocabulary size (128,256 ids): the allowed-token bitmask, 4,008 uint32 words a
  state, dominates; moves are what the default next state does not cover."""
  tok = synthetic_bpe()
  v = TokenVocabulary.from_tokenizer(tok)
  assert v.vocab_size == 128_256
  automaton = _compile(Constraint.json_schema(PERSON), v)
  a, m = automaton.num_states, automaton.num_moves
  assert automaton.allowed_AU.shape == (a, 4008) and automaton.allowed_AU.dtype == np.uint32
  assert automaton.table_bytes == a * (4008 * 4 + 4 * 4 + 1) + m * 8
  assert m < 0.2 * sum(len(automaton.allowed_tokens(s)) for s in range(a))
  packed = pack([automaton], v.vocab_size, v.mask_id)
  assert packed.tables.nbytes == bucket(a + 2, 8) * (4008 * 4 + 17) + bucket(m, 16) * 8
  assert packed.tables.nbytes < 8 << 20
  document = '{"name":"Ann","age":31,"tags":["x","y"],"role":"a \\"quoted\\" \\\\ role"}'
  jsonschema.validate(json.loads(document), PERSON)
  ids = tok.encode(document)
  assert _accepts(automaton, ids, v.eos_id)
  tables = jax.tree.map(jnp.asarray, packed.tables)
  after = device.advance(tables, jnp.array([packed.initial_states[0]]), jnp.array([ids]))
  assert bool(device.is_final(tables, after[0, -1])) and not bool((after == DEAD).any())
