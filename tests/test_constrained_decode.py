"""Constrained decoding (`decode.constrained`): every output within its constraint, NTP's,
plain SBD's and verified SBD's, on models never trained to produce it; verified equal to an
uncached constrained NTP reference token for token; mixed batches equal their rows alone; a
constraint that cannot finish within the limit ends incomplete, never claimed as complete."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from constrain_helpers import regexes, schemas  # tests/ is on sys.path
from decode_helpers import EOS, MASK, decode_settings, peaky_model, recompute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbd_jax.constrain.spec import Constraint, ConstraintError
from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode import automata, sampler
from sbd_jax.decode.state import prompt_keys

TOKENIZER = ByteTokenizer()
PROMPTS = ["Q: a date?", "Name it", "x", "The answer is"]
PERSON = {
  "type": "object",
  "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
  "required": ["name", "age"],
  "additionalProperties": False,
}
# Every object it allows is short: a bounded automaton, which any model finishes.
FLAGS = {
  "type": "object",
  "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
  "required": ["ok", "color"],
  "additionalProperties": False,
}
# NTP, plain SBD and verified SBD (every forward the block's, and choosing its forwards).
DECODINGS = {
  "ntp": dict(mode="ntp"),
  "plain": dict(verify=False),
  "verified": dict(verify=True, adaptive=False),
  "verified, chosen": dict(verify=True, wide_cost=3.0),
}


@pytest.fixture(scope="module")
def model():
  return peaky_model()


def _settings(constraint, max_new=40, **kw):
  s = decode_settings(block_size=4, gamma=0.5, max_new_tokens=max_new, **kw)
  return s.replace(constraint=constraint, wide_cost=kw.get("wide_cost", 1.0))


def _decode(model, constraint, decoding, prompts=PROMPTS, seed=0, **kw):
  s = _settings(constraint, **{**DECODINGS[decoding], **kw})
  return sampler.decode_text(model, TOKENIZER, prompts, s, seed=seed)


def _texts_are_valid(out, valid, max_new):
  """Each text is valid where the automaton calls it complete; an incomplete one ran out of
  tokens, and none claims completeness it lacks."""
  for text, tokens, complete in zip(out.texts, out.tokens, out.complete):
    if complete:
      assert valid(text), text
      assert tokens[-1] == EOS or len(tokens) == max_new
    else:
      assert len(tokens) == max_new and EOS not in tokens, (text, tokens)


@pytest.mark.integration
@pytest.mark.parametrize(
  "decoding",
  [
    d if d == "verified, chosen" else pytest.param(d, marks=pytest.mark.integration)
    for d in DECODINGS
  ],
)
def test_every_output_satisfies_its_constraint(model, decoding):
  """A date regex, a choice, two JSON schemas and any JSON object: NTP, plain and verified SBD
  on an untrained model write only what the constraint allows; the three whose texts are bounded
  (the date, the choice, a schema of a boolean and an enum) finish. A person's age and any
  JSON object need not: the untrained model writes digits and keys of random characters."""
  date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
  cases = [
    (Constraint.regex(date), lambda t: re.fullmatch(date, t), True),
    (Constraint.choice(["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not"), True),
    (Constraint.json_schema(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None, False),
    (Constraint.json_schema(FLAGS), lambda t: jsonschema.validate(json.loads(t), FLAGS) is None, True),
    (Constraint.json_object(), lambda t: isinstance(json.loads(t), dict), False),
  ]  # fmt: skip
  for constraint, valid, bounded in cases:
    out = _decode(model, constraint, decoding, max_new=60)
    _texts_are_valid(out, valid, 60)
    assert out.complete.all() or not bounded, (constraint, out.texts)
    assert MASK not in sum(out.tokens, [])


@pytest.mark.parametrize(
  "decoding", [pytest.param("plain", marks=pytest.mark.integration), "verified, chosen"]
)
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(pattern=regexes(), seed=st.integers(0, 1000))
def test_random_regexes_are_matched(model, decoding, pattern, seed):
  try:
    constraint = Constraint.regex(pattern)
    out = _decode(model, constraint, decoding, max_new=24, temperature=1.0, seed=seed)
  except ConstraintError:  # refused (one line): nothing decoded
    return
  _texts_are_valid(out, lambda t: re.fullmatch(pattern, t), 24)


# Integration (34 s on a 2-core CPU): the random regexes above keep a constrained decode's
# property in the default tier, and tests/test_constrain.py the schemas' compilation.
@pytest.mark.integration
@pytest.mark.parametrize("decoding", ["ntp", "verified, chosen"])
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas())
def test_random_schemas_are_validated(model, decoding, schema):
  try:
    out = _decode(model, Constraint.json_schema(schema), decoding, max_new=48)
  except ConstraintError:
    return
  _texts_are_valid(out, lambda t: jsonschema.validate(json.loads(t), schema) is None, 48)


def _reference(model, prompt_ids, s, automaton, key):
  """Uncached constrained NTP: every token from a forward over the whole text, its logits
  masked to what the automaton allows (and the mask token), greedy or the Gumbel-max draw fixed
  by (the row's key, the slot)."""
  gen, state = [], 0
  while len(gen) < s.max_new_tokens:
    tokens = prompt_ids + gen
    logits = np.array(recompute(model, tokens, num_clean=len(tokens))[0, -1], np.float32)
    allowed = np.zeros_like(logits, bool)
    allowed[automaton.allowed_tokens(state)] = True
    allowed[MASK] = False
    logits = np.where(allowed, logits, -np.inf)
    if s.temperature == 0:
      token = int(np.argmax(logits))
    else:
      k = jax.random.fold_in(key, len(gen))
      token = int(jax.random.categorical(k, jnp.asarray(logits) / s.temperature))
    gen.append(token)
    state = automaton.next_state(state, token)
    if token == EOS:
      break
  return gen


@pytest.mark.parametrize(
  "decoding, temperature",
  [
    ("verified, chosen", 0.0),
    ("verified", 0.8),
    pytest.param("verified", 0.0, marks=pytest.mark.integration),
    pytest.param("ntp", 0.8, marks=pytest.mark.integration),
  ],
)
def test_verified_is_the_uncached_constrained_ntp_reference(model, decoding, temperature):
  """Greedy and sampled with one seed: every verified decode's text (and NTP's own) equals the
  uncached reference that masks each of NTP's choices by the automaton."""
  constraint = Constraint.json_schema(PERSON)
  s = _settings(constraint, max_new=30, **DECODINGS[decoding], temperature=temperature)
  vocab = automata.vocabulary(TOKENIZER, s, 260)
  automaton = automata.compiler().compile(constraint, vocab)
  ids = [TOKENIZER.encode_document(p) for p in PROMPTS[:3]]
  out = sampler.decode(model, ids, s, seed=5, tokenizer=TOKENIZER)
  keys = prompt_keys(jnp.uint32(5), jnp.arange(len(ids)))
  for i, prompt in enumerate(ids):
    assert out.tokens[i] == _reference(model, prompt, s, automaton, keys[i]), i


@pytest.mark.integration
def test_mixed_batches_equal_each_row_alone(model):
  """Rows with different constraints and none share one batch (one program, one table set),
  each decoding as it does alone, greedy and sampled, in batches and refilled."""
  constraints = [
    Constraint.json_schema(PERSON),
    None,
    Constraint.choice(["yes", "no"]),
    Constraint.regex("[a-c]{2,5}"),
  ]
  ids = [TOKENIZER.encode_document(p) for p in PROMPTS]
  s = _settings(None, max_new=16, verify=True, temperature=0.7).replace(refill=False)
  alone = []
  for i, c in enumerate(constraints):
    one = sampler.decode(model, ids, s.replace(constraint=c), seed=2, tokenizer=TOKENIZER)
    alone.append(one.tokens[i])
  for batch, refill in ((None, False), (2, True)):
    mixed = sampler.decode(
      model, ids, s.replace(refill=refill), seed=2, tokenizer=TOKENIZER,
      constraints=constraints, batch_size=batch,
    )  # fmt: skip
    assert mixed.tokens == alone, (batch, refill)
    assert mixed.complete[1]  # an unconstrained row is complete as it ends


@pytest.mark.integration
@pytest.mark.parametrize(
  "decoding, temperature, refill",
  [
    ("verified, chosen", 0.7, True),
    pytest.param("verified, chosen", 0.7, False, marks=pytest.mark.integration),
    pytest.param("plain", 0.7, True, marks=pytest.mark.integration),
    pytest.param("verified", 0.0, False, marks=pytest.mark.integration),
    pytest.param("ntp", 0.7, True, marks=pytest.mark.integration),
  ],
)
def test_rows_without_a_constraint_decode_as_in_an_unconstrained_program(
  model, monkeypatch, decoding, temperature, refill
):
  """A constrained program (one a server's pools compile) whose rows hold no constraint skips
  the automaton's work (`constrained.any_row`) and decodes as the unconstrained program does:
  tokens, reveal steps, forwards of each kind and acceptance, refilled and in batches. (Each
  call runs its own program: an unconstrained verified decode would otherwise run NTP's where
  its drafts do not pay, `sampler._verifies`.)"""
  monkeypatch.setattr(sampler, "_verifies", lambda *_: True)
  ids = [TOKENIZER.encode_document(p) for p in PROMPTS]
  s = _settings(None, max_new=16, **DECODINGS[decoding], temperature=temperature)
  s = s.replace(refill=refill)
  alone = sampler.decode(model, ids, s, seed=4, batch_size=2)
  pooled = sampler.decode(
    model, ids, s, seed=4, batch_size=2, tokenizer=TOKENIZER, constraints=[None] * len(ids)
  )
  assert pooled.tokens == alone.tokens
  assert pooled.reveal_step == alone.reveal_step
  np.testing.assert_array_equal(pooled.nfe, alone.nfe)
  assert (pooled.forwards, pooled.wide_forwards, pooled.ntp_forwards) == (
    alone.forwards, alone.wide_forwards, alone.ntp_forwards,
  )  # fmt: skip
  if alone.accepted_tokens is not None:
    np.testing.assert_array_equal(pooled.accepted_tokens, alone.accepted_tokens)


def test_a_constraint_that_cannot_finish_ends_incomplete(model):
  """A schema whose shortest text is longer than the token limit: the row ends at its limit,
  reported incomplete (`complete` False), its text a prefix of a valid one."""
  long = {"type": "object", "properties": {"a_long_property_name": {"type": "integer"}},
          "required": ["a_long_property_name"]}  # fmt: skip
  out = _decode(model, Constraint.json_schema(long), "verified, chosen", max_new=12)
  assert not out.complete.any()
  start = '{"a_long_property_name":'  # JSON's whitespace aside
  assert all(start.startswith(re.sub(r"\s", "", t)) for t in out.texts), out.texts


def test_forced_tokens_are_drafted_and_counted(model):
  """A choice among long strings is mostly forced: verified decoding drafts the forced tokens
  (masked drafts) and settles them with its checks, in fewer forwards than drafting unmasked;
  the text is the same."""
  constraint = Constraint.choice(["the first long option", "the second long option"])
  masked = _decode(model, constraint, "verified", max_new=30)
  unmasked = _decode(model, constraint, "verified", max_new=30, forced_tokens=False)
  assert masked.texts == unmasked.texts
  assert (masked.forced_tokens > 10).all()
  assert masked.nfe.sum() < unmasked.nfe.sum()


def test_a_constrained_decode_needs_its_tokenizer_and_a_valid_constraint(model):
  s = _settings(Constraint.regex("[0-9]+"))
  with pytest.raises(ValueError, match="needs the tokenizer") as info:
    sampler.decode(model, [[257, 65]], s)
  assert "\n" not in str(info.value)
  with pytest.raises(ConstraintError) as info:
    _decode(model, Constraint.regex("(unclosed"), "plain")
  assert "\n" not in str(info.value)
