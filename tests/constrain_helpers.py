"""Tokenizers, random walks and an outlines-core comparison for tests/test_constrain.py.

Three tokenizer kinds, built offline: the byte tokenizer, the project's word vocabulary
(`sbd_jax.data.vocab`, byte fallback) and a byte-level BPE trained with `tokenizers` in the
style of Qwen-3 (specials <|endoftext|>, <|im_start|>, <|im_end|> = EOS, a non-special added
token, the mask past the vocabulary); and a synthetic byte-level BPE of ~128k tokens in the
style of Llama-3 (256 reserved specials; `benchmarks.structured_task`, whose benchmark measures
the tables' memory at that size) for the tables' memory.
"""

from __future__ import annotations

import collections
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from benchmarks.structured_task import synthetic_bpe  # noqa: F401  (the tests' 128k vocabulary)
from sbd_jax.constrain import device
from sbd_jax.constrain.tables import DEAD, UNCONSTRAINED, PackedTables
from sbd_jax.data import vocab
from sbd_jax.data.tokenizer import HFTokenizer

CORPUS = [
  '{"name": "Ann", "age": 31, "tags": ["a", "b"], "ok": true, "score": -2.5e3}',
  'The quick brown fox jumps over the lazy dog. {"x": null, "y": [1, 2, 3]}',
  'naïve café ✓ 日本 — "quoted" and back\\slash, yes or no; 0123456789 é',
  '[{"id": "7f3c", "when": "2024-01-02"}, {"id": "a9", "when": null}]',
]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WALK_STEPS = 256


def word_tokenizer(folder: str) -> HFTokenizer:
  """The project's word vocabulary over CORPUS, saved and loaded as training does."""
  texts = [t for _ in range(30) for t in CORPUS]
  return HFTokenizer.from_path(
    vocab.save(vocab.build_from_corpus(texts, 400), folder), prepend_bos=True
  )


def bpe_tokenizer(folder: str, vocab_size: int = 600) -> HFTokenizer:
  """A byte-level BPE trained on CORPUS (Qwen-3's layout of specials, an added `<think>`)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=QWEN_SPECIALS,
    show_progress=False,
  )
  tok.train_from_iterator([t for _ in range(30) for t in CORPUS], trainer)
  tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
  _save(tok, folder, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
  return HFTokenizer.from_path(folder)


def _save(tok, folder: str, specials: dict) -> None:
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **specials}, f)


def distance_to_final(packed: PackedTables, automata) -> np.ndarray:
  """int32 [A]: the fewest tokens from each packed state to a final one (host API, breadth
  first over reversed moves); DEAD and padding far away."""
  far = 1 << 20
  dist_A = np.full(packed.tables.final_A.shape[0], far, np.int32)
  dist_A[UNCONSTRAINED] = 0
  for offset, automaton in zip(packed.initial_states, automata):
    into = collections.defaultdict(set)
    for s in range(automaton.num_states):
      for t in automaton.allowed_tokens(s):
        into[automaton.next_state(s, int(t))].add(s)
    todo = collections.deque(s for s in range(automaton.num_states) if automaton.is_final(s))
    for s in todo:
      dist_A[offset + s] = 0
    while todo:
      s = todo.popleft()
      for before in into[s]:
        if dist_A[offset + before] == far:
          dist_A[offset + before] = dist_A[offset + s] + 1
          todo.append(before)
  return dist_A


@functools.partial(jax.jit, static_argnames=("steps", "budget", "vocab_size", "eos_id"))
def _walk(tables, dist_A, state_B, key, *, steps, budget, vocab_size, eos_id):
  """Tokens and states [B, steps]: uniform among the allowed tokens for `budget` steps, then
  towards a final state (fewest tokens left), EOS first where allowed."""
  token_V = jnp.arange(vocab_size)

  def step(carry, t):
    state_B, key = carry
    key, sub = jax.random.split(key)
    score_BV = jax.random.gumbel(sub, (state_B.shape[0], vocab_size))
    next_BV = device.next_state(
      tables, jnp.broadcast_to(state_B[:, None], score_BV.shape), token_V[None]
    )
    closing = t >= budget
    score_BV = score_BV - jnp.where(closing, 1e3 * dist_A[next_BV], 0.0)
    score_BV = score_BV + jnp.where(closing & (token_V == eos_id), 1e4, 0.0)[None]
    masked_BV = device.mask_logits(tables, score_BV[:, None], state_B[:, None])[:, 0]
    token_B = jnp.argmax(masked_BV, axis=-1).astype(jnp.int32)
    new_B = device.next_state(tables, state_B, token_B)
    return (new_B, key), (token_B, new_B)

  _, (tokens_TB, states_TB) = jax.lax.scan(step, (state_B, key), jnp.arange(steps))
  return tokens_TB.T, states_TB.T


def walk(packed: PackedTables, automata, initial_B, vocabulary, seed: int, budget: int = 24):
  """Random walks through the device tables from `initial_B`: per row the token ids up to (not
  including) its first EOS, and whether it ended (EOS in a final state). Every row ends: once
  closing, each step takes a token one nearer a final state. None where that could take more
  than WALK_STEPS."""
  dist_A = distance_to_final(packed, automata)
  longest = int(dist_A[dist_A < (1 << 20)].max())
  if budget + longest + 2 > WALK_STEPS:
    return None
  tokens_BT, states_BT = _walk(
    jax.tree.map(jnp.asarray, packed.tables),
    jnp.asarray(np.minimum(dist_A, 1 << 12)),
    jnp.asarray(initial_B, jnp.int32),
    jax.random.key(seed),
    steps=WALK_STEPS,
    budget=budget,
    vocab_size=vocabulary.vocab_size,
    eos_id=vocabulary.eos_id,
  )
  tokens_BT, states_BT = np.asarray(tokens_BT), np.asarray(states_BT)
  assert (states_BT != DEAD).all(), "a walk chose a token its state did not allow"
  out = []
  for tokens_T in tokens_BT:
    ends = np.flatnonzero(tokens_T == vocabulary.eos_id)
    out.append((tokens_T[: ends[0]].tolist() if len(ends) else tokens_T.tolist(), len(ends) > 0))
  return out


def text_of(ids, vocabulary) -> bytes:
  return b"".join(vocabulary.token_bytes[i] for i in ids)


_next_state = jax.jit(device.next_state)


def assert_matches_index(packed: PackedTables, offset: int, index, vocab_size: int, eos_id: int):
  """The packed automaton at `offset` is outlines-core's `index` of the constraint's regex
  followed by the end marker (token id `vocab_size`): a bijection of states that pairs the
  initial states and every (state, token) -> next state but the marker's, and makes final (EOS
  to itself) exactly the states whose marker token leads to a final state of the index; states
  from which no final state can be reached are dropped. Returns the number of states paired."""
  tables = jax.tree.map(jnp.asarray, packed.tables)
  raw, raw_finals = index.get_transitions(), set(index.get_final_states())

  finals = {s for s, moves in raw.items() if moves.get(vocab_size, -1) in raw_finals}
  live = set(finals)  # states a final state can be reached from (real tokens only)
  while grown := {
    s
    for s, m in raw.items()
    if s not in live and any(n in live for t, n in m.items() if t < vocab_size)
  }:
    live |= grown

  def expected_moves(state):
    moves = raw.get(state, {}).items()
    kept = {t: n for t, n in moves if t not in (vocab_size, eos_id) and n in live}
    return {**kept, eos_id: state} if state in finals else kept

  ours = {index.get_initial_state(): offset}
  todo, token_V = [index.get_initial_state()], jnp.arange(vocab_size)
  while todo:
    state = todo.pop()
    here = ours[state]
    next_V = np.asarray(_next_state(tables, jnp.full(vocab_size, here), token_V))
    expected = expected_moves(state)
    assert set(np.flatnonzero(next_V != DEAD).tolist()) == set(expected), f"state {state}"
    assert bool(packed.tables.final_A[here]) == (eos_id in expected)
    for token, nxt in expected.items():
      if nxt not in ours:
        assert next_V[token] not in ours.values(), "two outlines states share one of ours"
        ours[nxt] = int(next_V[token])
        todo.append(nxt)
      assert next_V[token] == ours[nxt], f"state {state} token {token}"
  return len(ours)


# --- random regexes and JSON schemas (hypothesis strategies) -----------------------------------

ATOMS = ["a", "b", "c", "0", "7", " ", "é", "日", r"\.", r"\{", '"', "-", ",", "[a-c]", "[0-9]",
         "[^a]", "[a-cé]", "."]  # fmt: skip


def regexes():
  def grow(children):
    return st.one_of(
      st.lists(children, min_size=2, max_size=3).map("".join),
      st.lists(children, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
      st.tuples(children, st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{0,2}"])).map(
        lambda t: f"(?:{t[0]}){t[1]}"
      ),
    )

  return st.recursive(st.sampled_from(ATOMS), grow, max_leaves=8)


NAMES = ["a", "name", "x.y", "with space", "é", "k-1", "$v", "[0]", "日本"]
STRINGS = ["", "a", 'quote"d', "back\\slash", "日本", "tab\t", "x|y", ".*"]
PATTERNS = ["^[a-z]+$", "[A-Z][a-z]{0,3}", "x|y", "^(ab)*$", "[0-9]{2,3}", "é+"]
DEFS = {"flag": {"enum": ["on", "off"]}}
PAIR = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}


def literals():
  scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1000, 1000),
    st.integers(-(10**6), 10**6).map(lambda i: i / 64),  # fractions outlines-core reads exactly
    st.sampled_from(STRINGS),
  )
  keys = st.sampled_from(["a", "b c", "é", "k_1"])  # enum / const keys: no metacharacters
  return st.recursive(
    scalars,
    lambda c: st.one_of(st.lists(c, max_size=2), st.dictionaries(keys, c, max_size=2)),
    max_leaves=4,
  )


def leaf_schemas():
  strings = st.tuples(st.integers(0, 2), st.integers(0, 3)).map(
    lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}
  )
  integers = st.tuples(st.integers(-50, 50), st.integers(0, 300), st.integers(0, 3)).map(
    lambda t: {"type": "integer", **[
      {"minimum": t[0], "maximum": t[0] + t[1]},
      {"minimum": t[0]},
      {"maximum": t[0] + t[1] + 0.5},
      {"exclusiveMinimum": t[0] - 0.5, "exclusiveMaximum": t[0] + t[1] + 1},
    ][t[2]]}
  )  # fmt: skip
  return st.one_of(
    integers,
    st.sampled_from(
      [{"type": n} for n in ("string", "integer", "number", "boolean", "null")]
      + [
        {"type": ["string", "null"]},
        {"type": ["integer", "boolean"]},
        {"format": "uuid", "type": "string"},
      ]
      + [
        {"$ref": "#/$defs/flag"},
        {"$ref": "#/definitions/pair"},
        {"type": "object", "maxProperties": 2},
      ]
    ),
    strings,
    st.sampled_from([{"type": "string", "pattern": p} for p in PATTERNS]),
    st.lists(literals(), min_size=1, max_size=3).map(lambda vs: {"enum": vs}),
    literals().map(lambda v: {"const": v}),
  )


def objects(children):
  def build(t):
    properties, required, closed = t
    out = {"type": "object", "properties": properties, "required": required}
    return {**out, "additionalProperties": False} if closed else out

  props = st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3)
  return props.flatmap(
    lambda p: st.tuples(st.just(p), st.lists(st.sampled_from(list(p)), unique=True), st.booleans())
  ).map(build)


def schemas():
  def grow(children):
    return st.one_of(
      objects(children),
      st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
      ),
      st.lists(children, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
      st.lists(children, min_size=1, max_size=2).map(
        lambda xs: {"type": "array", "prefixItems": xs}
      ),
      children.map(lambda x: {"allOf": [x], "title": "one schema", "description": "annotations"}),
    )

  root = st.recursive(leaf_schemas(), grow, max_leaves=6)
  root = root.map(lambda s: s if isinstance(s, dict) else {"allOf": [s]})
  return root.map(lambda s: {**s, "$defs": DEFS, "definitions": {"pair": PAIR}})
