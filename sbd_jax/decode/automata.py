"""The host side of constrained decoding: a decode's constraints compiled over its tokenizer to
one table set for its rows (`sbd_jax.constrain`), and each row's initial automaton state.

Compiles run in one process-wide `ConstraintCompiler` (a worker process, bounded in time and
size, with a cache), made on first use; `decode.constrained` reads the tables on device.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from sbd_jax.constrain import tables as tables_lib
from sbd_jax.constrain.compiler import ConstraintCompiler
from sbd_jax.constrain.spec import Constraint
from sbd_jax.constrain.vocabulary import TokenVocabulary
from sbd_jax.decode.settings import SamplerSettings

_COMPILER: list[ConstraintCompiler] = []
_LOCK = threading.Lock()
# The least a decode's table set holds (`tables.pack`'s floors): decodes of constraints this
# small share one table shape, so one compiled program (at a 128k vocabulary, 64 states are
# 1 MiB of tables).
MIN_STATES, MIN_MOVES = 64, 1024


def compiler() -> ConstraintCompiler:
  """The process's constraint compiler (its worker starts on the first compile)."""
  with _LOCK:
    if not _COMPILER:
      _COMPILER.append(ConstraintCompiler())
    return _COMPILER[0]


def vocabulary(tokenizer, s: SamplerSettings, vocab_size: int) -> TokenVocabulary:
  """The tokenizer's vocabulary over the model's `vocab_size` logits, with the decode's EOS and
  mask ids (the run's mask may be an id the tokenizer does not name)."""
  vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size)
  never = {s.mask_id, s.eos_id, s.pad_id}
  token_bytes = tuple(None if i in never else b for i, b in enumerate(vocab.token_bytes))
  return TokenVocabulary(token_bytes, eos_id=s.eos_id, mask_id=s.mask_id)


@dataclasses.dataclass(frozen=True)
class RowAutomata:
  """A table set for a decode's rows and where each row starts (`decode.constrained`)."""

  ctables: tables_lib.ConstraintTables  # device arrays
  first_state_B: np.ndarray  # int32: 0 where a row is unconstrained


def compile_rows(
  constraints: Sequence[Constraint | None], vocab: TokenVocabulary, mask_id: int
) -> RowAutomata:
  """Each row's constraint (None: unconstrained) compiled and packed into one table set; a
  constraint that cannot be compiled raises its one-line ConstraintError."""
  unique = list(dict.fromkeys(c for c in constraints if c is not None))
  automata = [compiler().compile(c, vocab) for c in unique]
  packed = tables_lib.pack(automata, vocab.vocab_size, mask_id, MIN_STATES, MIN_MOVES)
  start = dict(zip(unique, packed.initial_states))
  first_state_B = np.asarray(
    [tables_lib.UNCONSTRAINED if c is None else start[c] for c in constraints], np.int32
  )
  ctables = tables_lib.ConstraintTables(*(jnp.asarray(x) for x in packed.tables))
  return RowAutomata(ctables, first_state_B)
