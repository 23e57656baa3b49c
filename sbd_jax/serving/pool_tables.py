"""A constrained pool's table set (`serving.pool`): the automata of its rows' constraints packed
into one `ConstraintTables` of a fixed capacity, on device, and where each row's states sit.

Every table set a pool passes to `slots.admit` / `slots.advance` has the capacity's shapes
(`Capacity`: A states, M moves, padded as `constrain.tables.bucket` pads), so admitting any
constraint that fits compiles nothing. The tables hold the constraints of the rows that decode
and of rows that have finished since the last repack. A row whose constraint is packed already
starts at its offset; a new constraint repacks the tables with the live rows' constraints and
the new one (in their order: offsets move only past a dropped constraint), and the live rows
whose constraint moved are shifted on device at the next advance (`shift_B`: new offset - the
offset their state was written at; `slots.advance` adds it to every constrained state). A
constraint that does not fit beside the live ones waits (`place` returns None); one that does
not fit alone is refused at request time (`Capacity.check`).

Dimension letters (docs/dimensions.md): B rows, A automaton states, M moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from sbd_jax.constrain import tables as tables_lib
from sbd_jax.constrain.automaton import TokenAutomaton
from sbd_jax.constrain.spec import Constraint, ConstraintError

# The flags' defaults: any JSON object (`json_object`: 399 states over the byte vocabulary; 369
# states and 40,698 moves over a 128,256-id byte-level BPE, where a two-property schema has 82
# and 38,816) with room beside it. At 128,256 ids a state costs 16,049 bytes of tables (16 MiB
# for 1,024), a move 8 (1 MiB for 131,072).
STATES, MOVES = 1024, 131072


@dataclasses.dataclass(frozen=True)
class Capacity:
  """What a pool's table set holds: `states` (the two reserved ones included) and `moves`, each
  rounded up to a table bucket (2^k or 3 * 2^(k-1))."""

  states: int = STATES
  moves: int = MOVES

  def __post_init__(self):
    if self.states < tables_lib.RESERVED_STATES + 1 or self.moves < 1:
      raise ValueError(
        f"--constraint_states={self.states} and --constraint_moves={self.moves}: give at least "
        f"{tables_lib.RESERVED_STATES + 1} states and 1 move"
      )

  @property
  def num_states(self) -> int:
    """A: the states of every table set (the bucket of `states`)."""
    return tables_lib.bucket(self.states, self.states)

  @property
  def num_moves(self) -> int:
    """M: the moves of every table set (the bucket of `moves`)."""
    return tables_lib.bucket(self.moves, self.moves)

  def fits(self, automata: list[TokenAutomaton]) -> bool:
    states = tables_lib.RESERVED_STATES + sum(a.num_states for a in automata)
    return states <= self.num_states and sum(a.num_moves for a in automata) <= self.num_moves

  def check(self, automaton: TokenAutomaton) -> None:
    """A one-line ConstraintError for an automaton that does not fit a table set alone."""
    if not self.fits([automaton]):
      raise ConstraintError(
        f"the constraint is too large for this server's tables: {automaton.num_states} "
        f"automaton states and {automaton.num_moves} moves, of {self.num_states - 2} states "
        f"and {self.num_moves} moves (--constraint_states={self.states}, "
        f"--constraint_moves={self.moves})"
      )

  def table_bytes(self, vocab_size: int) -> int:
    """The bytes of one table set over `vocab_size` tokens."""
    a, m = self.num_states, self.num_moves
    return a * (4 * -(-vocab_size // 32) + 17) + m * 8  # `constrain.tables`' layout


class PoolTables:
  """The packed automata of one pool's rows and the device tables (see the module)."""

  def __init__(
    self,
    capacity: Capacity,
    rows: int,
    vocab_size: int,
    mask_id: int,
    place: Callable[[tables_lib.ConstraintTables], tables_lib.ConstraintTables],
  ):
    self.capacity, self.vocab_size, self.mask_id, self.place = capacity, vocab_size, mask_id, place
    self.constraint_B: list[Constraint | None] = [None] * rows  # a live row's constraint
    self.written_B = np.zeros(rows, np.int32)  # the offset each row's state was written at
    self.repacks = self.moved_rows = 0  # how often the tables were repacked; rows shifted
    self._pack({})

  def _pack(self, automata: dict[Constraint, TokenAutomaton]) -> None:
    c = self.capacity
    packed = tables_lib.pack(
      list(automata.values()), self.vocab_size, self.mask_id, c.num_states, c.num_moves
    )
    shapes = (packed.tables.allowed_AU.shape[0], packed.tables.move_token_M.shape[0])
    if shapes != (c.num_states, c.num_moves):
      raise RuntimeError(f"tables of {shapes} (states, moves) in a pool of {c}")
    self.automata = automata
    self.offsets = dict(zip(automata, packed.initial_states))
    self.ctables = self.place(packed.tables)

  def place_row(self, row: int, constraint: Constraint | None, automaton) -> int | None:
    """Row `row`'s initial state for `constraint` (0: none), repacking the tables if it is not
    packed; None if it does not fit beside the live rows' constraints (nothing changes)."""
    if constraint is None:
      self.constraint_B[row] = None
      return tables_lib.UNCONSTRAINED
    if constraint not in self.offsets:
      live = dict.fromkeys(c for c in self.constraint_B if c is not None)
      kept = {c: a for c, a in self.automata.items() if c in live}
      if not self.capacity.fits([*kept.values(), automaton]):
        return None
      self._pack({**kept, constraint: automaton})
      self.repacks += 1
    self.constraint_B[row] = constraint
    self.written_B[row] = self.offsets[constraint]
    return int(self.offsets[constraint])

  def free(self, row: int) -> None:
    """Row `row` no longer decodes: its constraint may leave the tables at the next repack."""
    self.constraint_B[row] = None

  def shift_B(self) -> np.ndarray:
    """int32 [B]: what each live row's states move by since they were written (0 elsewhere);
    the states are taken as moved (the next `slots.advance` moves them)."""
    shift_B = np.zeros(len(self.constraint_B), np.int32)
    for row, constraint in enumerate(self.constraint_B):
      if constraint is not None:
        shift_B[row] = self.offsets[constraint] - self.written_B[row]
        self.written_B[row] = self.offsets[constraint]
    self.moved_rows += int(np.count_nonzero(shift_B))
    return shift_B
