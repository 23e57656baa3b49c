"""Several token automata in one table set, for one batch and one compiled program.

Global states: 0 is UNCONSTRAINED (every token but the mask allowed, each leading back to 0,
final: a row without a constraint), 1 is DEAD (nothing allowed, not final: where a token the
state did not allow leads), then each automaton's states at its own offset (its local state s
is global offset + s; `PackedTables.initial_states` are the offsets, where its rows start).
A row's state is one int32 in [0, A); rows with different constraints, or none, share the
tables.

The tables are padded to size buckets (`bucket`: 2^k and 3 * 2^(k-1)), so that table sets of
similar sizes have equal shapes and reuse one compiled program; padding states are like DEAD.

`ConstraintTables` (a NamedTuple: a pytree for jit), with A states, U = ceil(V / 32) words,
M moves:

    allowed_AU    uint32 [A, U]  allowed tokens, token t = bit t % 32 of word t // 32
    default_A     int32  [A]     next state of an allowed token not among the state's moves
    move_start_A  int32  [A]     the state's moves: [start, start + count) of the M axis,
    move_count_A  int32  [A]       sorted by token
    move_token_M  int32  [M]     a move's token
    move_next_M   int32  [M]     a move's next state
    final_A       bool   [A]     the text so far is complete (EOS allowed)
    forced_A      int32  [A]     the single allowed token (EOS not allowed), else -1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sbd_jax.constrain.automaton import TokenAutomaton, words
from sbd_jax.constrain.spec import ConstraintError

UNCONSTRAINED = 0
DEAD = 1
RESERVED_STATES = 2
MIN_STATES = 8
MIN_MOVES = 16


class ConstraintTables(NamedTuple):
  """One batch's automata; see the module docstring for the layout."""

  allowed_AU: np.ndarray
  default_A: np.ndarray
  move_start_A: np.ndarray
  move_count_A: np.ndarray
  move_token_M: np.ndarray
  move_next_M: np.ndarray
  final_A: np.ndarray
  forced_A: np.ndarray

  @property
  def nbytes(self) -> int:
    return sum(int(np.asarray(x).nbytes) for x in self)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedTables:
  """The tables, where each automaton's rows start, and the sizes before padding."""

  tables: ConstraintTables
  initial_states: tuple[int, ...]
  num_states: int
  num_moves: int


def bucket(n: int, minimum: int) -> int:
  """The smallest of 2^k and 3 * 2^(k-1) that is >= max(n, minimum)."""
  n = max(n, minimum)
  size = 1 << (n - 1).bit_length()
  return size * 3 // 4 if size * 3 // 4 >= n and size >= 4 else size


def _reserved(vocab_size: int, mask_id: int) -> TokenAutomaton:
  """States 0 (UNCONSTRAINED) and 1 (DEAD), as local states 0 and 1 of one automaton."""
  every_V = np.ones(vocab_size, bool)
  every_V[mask_id] = False
  allowed_AU = np.zeros((RESERVED_STATES, words(vocab_size)), np.uint32)
  packed = np.packbits(np.pad(every_V, (0, 32 * words(vocab_size) - vocab_size)), bitorder="little")
  allowed_AU[UNCONSTRAINED] = packed.view("<u4")
  empty = np.zeros(0, np.int32)
  return TokenAutomaton(
    vocab_size=vocab_size,
    eos_id=-1,
    mask_id=mask_id,
    allowed_AU=allowed_AU,
    default_A=np.array([UNCONSTRAINED, DEAD], np.int32),
    move_start_A=np.zeros(RESERVED_STATES, np.int32),
    move_count_A=np.zeros(RESERVED_STATES, np.int32),
    move_token_M=empty,
    move_next_M=empty,
    final_A=np.array([True, False]),
    forced_A=np.full(RESERVED_STATES, -1, np.int32),
  )


def _stack(parts, field: str, shift_by, pad: int, fill) -> np.ndarray:
  """`field` of every part, each plus its entry of `shift_by` (None: as is), then `pad` x
  `fill`, in the field's dtype."""
  dtype = getattr(parts[0], field).dtype
  arrays = [getattr(p, field) if shift_by is None else getattr(p, field) + shift_by[i]
            for i, p in enumerate(parts)]  # fmt: skip
  tail = np.full((pad, *arrays[0].shape[1:]), fill, dtype)
  return np.concatenate([*arrays, tail]).astype(dtype)


def pack(
  automata: Sequence[TokenAutomaton],
  vocab_size: int,
  mask_id: int,
  min_states: int = MIN_STATES,
  min_moves: int = MIN_MOVES,
) -> PackedTables:
  """One table set holding the reserved states and `automata` (each once, in order), padded
  to buckets of at least `min_states` and `min_moves` (a caller that keeps one program for
  every batch passes the largest it allows)."""
  for automaton in automata:
    if (automaton.vocab_size, automaton.mask_id) != (vocab_size, mask_id):
      raise ConstraintError(
        f"an automaton over {automaton.vocab_size} tokens (mask {automaton.mask_id}) cannot "
        f"share tables over {vocab_size} tokens (mask {mask_id})"
      )
  parts = [_reserved(vocab_size, mask_id), *automata]
  state_at = np.cumsum([0, *(p.num_states for p in parts)]).astype(np.int32)
  move_at = np.cumsum([0, *(p.num_moves for p in parts)]).astype(np.int32)
  a, m = int(state_at[-1]), int(move_at[-1])
  a_pad, m_pad = bucket(a, min_states) - a, bucket(m, min_moves) - m
  tables = ConstraintTables(
    allowed_AU=_stack(parts, "allowed_AU", None, a_pad, 0),
    default_A=_stack(parts, "default_A", state_at, a_pad, DEAD),
    move_start_A=_stack(parts, "move_start_A", move_at, a_pad, m),
    move_count_A=_stack(parts, "move_count_A", None, a_pad, 0),
    move_token_M=_stack(parts, "move_token_M", None, m_pad, np.iinfo(np.int32).max),
    move_next_M=_stack(parts, "move_next_M", state_at, m_pad, DEAD),
    final_A=_stack(parts, "final_A", None, a_pad, False),
    forced_A=_stack(parts, "forced_A", None, a_pad, -1),
  )
  return PackedTables(tables, tuple(int(o) for o in state_at[1:-1]), a, m)
