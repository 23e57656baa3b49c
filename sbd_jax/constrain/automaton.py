"""A token automaton: one constraint compiled over one vocabulary, in the tables' layout.

outlines-core builds the index (`constrain.index`): the regex's byte DFA walked along every
token's bytes, one transition per (state, token) that keeps a match possible, and EOS from each
final (accepting) state to itself. `from_transitions` renumbers its states breadth-first from the initial state
(local state 0), drops states from which no final state can be reached (a vocabulary that
cannot spell a needed byte), and stores each state as:

* `allowed_AU`: the allowed tokens, a bitmask packed into uint32 words (token t is bit t % 32 of
  word t // 32);
* `default_A`: where most allowed tokens lead (for a JSON string's body, every token without a
  quote or a backslash), and `move_*`: the allowed tokens that lead elsewhere, sorted, with
  their next states (state a's are move_start_A[a] + [0, move_count_A[a]));
* `final_A`: whether the text so far is complete (EOS is allowed exactly there);
* `forced_A`: the single allowed token where exactly one is allowed and it is not EOS, else -1.

Dimension letters (docs/dimensions.md): A automaton states, U uint32 words of a vocabulary
bitmask, M moves (transitions listed one by one), V vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from sbd_jax.constrain.index import index_transitions, outlines_vocabulary
from sbd_jax.constrain.spec import ConstraintError
from sbd_jax.constrain.vocabulary import TokenVocabulary

DEAD = -1  # `next_state` of a token the state does not allow


def words(vocab_size: int) -> int:
  """U: uint32 words of a bitmask over `vocab_size` tokens."""
  return -(-vocab_size // 32)


def token_ids(words_U: np.ndarray, vocab_size: int) -> np.ndarray:
  """The ids whose bits are set in one packed bitmask, ascending (int32)."""
  bits = np.unpackbits(np.asarray(words_U, "<u4").view(np.uint8), bitorder="little")
  return np.flatnonzero(bits[:vocab_size]).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
  """One compiled constraint. Local states 0..a-1, 0 initial; see the module docstring."""

  vocab_size: int
  eos_id: int
  mask_id: int
  allowed_AU: np.ndarray  # uint32
  default_A: np.ndarray  # int32
  move_start_A: np.ndarray  # int32
  move_count_A: np.ndarray  # int32
  move_token_M: np.ndarray  # int32
  move_next_M: np.ndarray  # int32
  final_A: np.ndarray  # bool
  forced_A: np.ndarray  # int32
  compile_s: float = 0.0  # seconds outlines-core's index and these tables took

  @property
  def num_states(self) -> int:
    return len(self.final_A)

  @property
  def num_moves(self) -> int:
    return len(self.move_token_M)

  @property
  def table_bytes(self) -> int:
    arrays = [getattr(self, f.name) for f in dataclasses.fields(self)]
    return sum(x.nbytes for x in arrays if isinstance(x, np.ndarray))

  def allowed_tokens(self, state: int) -> np.ndarray:
    return token_ids(self.allowed_AU[state], self.vocab_size)

  def allows(self, state: int, token: int) -> bool:
    return 0 <= token < self.vocab_size and bool(
      self.allowed_AU[state, token >> 5] >> (token & 31) & 1
    )

  def next_state(self, state: int, token: int) -> int:
    """The state after `token`, or DEAD where the state does not allow it."""
    if not self.allows(state, token):
      return DEAD
    start = self.move_start_A[state]
    moves = self.move_token_M[start : start + self.move_count_A[state]]
    at = int(np.searchsorted(moves, token))
    found = at < len(moves) and moves[at] == token
    return int(self.move_next_M[start + at] if found else self.default_A[state])

  def is_final(self, state: int) -> bool:
    return bool(self.final_A[state])

  def forced_token(self, state: int) -> int:
    return int(self.forced_A[state])


@dataclasses.dataclass(frozen=True)
class Limits:
  """Bounds on one compiled automaton (refused beyond them)."""

  max_states: int = 8192
  max_table_bytes: int = 256 << 20


def _live_states(transitions: dict[int, dict[int, int]], finals: set[int]) -> set[int]:
  """States from which a final state can be reached."""
  into = collections.defaultdict(set)
  for state, moves in transitions.items():
    for nxt in set(moves.values()):
      into[nxt].add(state)
  live, todo = set(finals), list(finals)
  while todo:
    for before in into[todo.pop()] - live:
      live.add(before)
      todo.append(before)
  return live


def _breadth_first(transitions, initial: int, live: set[int]) -> list[int]:
  order, seen, todo = [], {initial}, collections.deque([initial])
  while todo:
    state = todo.popleft()
    order.append(state)
    moves = transitions.get(state, {})
    for token in sorted(moves):
      nxt = moves[token]
      if nxt in live and nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return order


def _state_rows(transitions, order: list[int]):
  """Per local state: (sorted tokens, local next states), edges into dropped states removed."""
  old_A = np.asarray(order, np.int64)
  sort_A = np.argsort(old_A)
  rows = []
  for state in order:
    moves = transitions.get(state, {})
    tokens = np.fromiter(moves.keys(), np.int64, len(moves))
    nexts = np.fromiter(moves.values(), np.int64, len(moves))
    at = np.minimum(np.searchsorted(old_A, nexts, sorter=sort_A), len(order) - 1)
    local = sort_A[at]
    keep = old_A[local] == nexts
    tokens, local = tokens[keep], local[keep]
    by_token = np.argsort(tokens)
    rows.append((tokens[by_token].astype(np.int32), local[by_token].astype(np.int32)))
  return rows


def from_transitions(
  transitions, initial: int, finals, vocabulary: TokenVocabulary, limits: Limits = Limits()
) -> TokenAutomaton:
  """The automaton of an index's transitions {state: {token: next}} (outlines-core's form)."""
  live = _live_states(transitions, set(finals))
  if initial not in live:
    raise ConstraintError("the constraint admits no complete text this vocabulary can spell")
  order = _breadth_first(transitions, initial, live)
  a, v = len(order), vocabulary.vocab_size
  table_bytes = a * (4 * words(v) + 17)
  if a > limits.max_states or table_bytes > limits.max_table_bytes:
    raise too_large(a, table_bytes, limits)
  rows = _state_rows(transitions, order)
  allowed_AU = np.zeros((a, words(v)), np.uint32)
  default_A, count_A, forced_A = (np.full(a, -1, np.int32) for _ in range(3))
  moves_token, moves_next = [], []
  for state, (tokens, nexts) in enumerate(rows):
    np.bitwise_or.at(
      allowed_AU[state], tokens >> 5, np.uint32(1) << (tokens & 31).astype(np.uint32)
    )
    targets, counts = np.unique(nexts, return_counts=True)
    default_A[state] = targets[np.argmax(counts)] if len(targets) else -1
    other = nexts != default_A[state]
    moves_token.append(tokens[other])
    moves_next.append(nexts[other])
    count_A[state] = int(other.sum())
    if len(tokens) == 1 and tokens[0] != vocabulary.eos_id:
      forced_A[state] = tokens[0]
  start_A = (np.cumsum(count_A) - count_A).astype(np.int32)
  old_final = set(finals)
  return TokenAutomaton(
    vocab_size=v,
    eos_id=vocabulary.eos_id,
    mask_id=vocabulary.mask_id,
    allowed_AU=allowed_AU,
    default_A=default_A,
    move_start_A=start_A,
    move_count_A=count_A,
    move_token_M=np.concatenate([np.zeros(0, np.int32), *moves_token]).astype(np.int32),
    move_next_M=np.concatenate([np.zeros(0, np.int32), *moves_next]).astype(np.int32),
    final_A=np.array([s in old_final for s in order], bool),
    forced_A=forced_A,
  )


def too_large(states: int, table_bytes: int, limits: Limits) -> ConstraintError:
  return ConstraintError(
    f"the constraint is too large: {states} automaton states and {table_bytes} table bytes "
    f"(limits {limits.max_states} states, {limits.max_table_bytes} bytes)"
  )


def compile_regex(
  regex: str, vocabulary: TokenVocabulary, limits: Limits = Limits(), outlines_vocab=None
) -> TokenAutomaton:
  """The automaton of `regex` over `vocabulary` (`outlines_vocab`: its outlines-core form, when
  the caller keeps one), refused beyond `limits`."""
  import time

  start = time.perf_counter()
  transitions, initial, finals = index_transitions(
    regex,
    outlines_vocab or outlines_vocabulary(vocabulary),
    end_id=vocabulary.vocab_size,
    eos_id=vocabulary.eos_id,
    what="constraint",
  )
  if len(transitions) > limits.max_states:
    raise too_large(len(transitions), len(transitions) * 4 * words(vocabulary.vocab_size), limits)
  automaton = from_transitions(transitions, initial, finals, vocabulary, limits)
  return dataclasses.replace(automaton, compile_s=time.perf_counter() - start)
