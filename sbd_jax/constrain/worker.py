"""The compile worker: `python -m sbd_jax.constrain.worker MEMORY_BYTES`.

A process of its own, so that a constraint that compiles too long can be killed (outlines-core's
index is one call into Rust that no thread can interrupt) and one that needs too much memory
dies here (an address-space limit of MEMORY_BYTES; 0: none) instead of in the server. It reads
requests from stdin and answers on stdout, each message a pickle after its 8-byte length:

    ("vocabulary", TokenVocabulary)                    -> ("ok", None)
    ("compile", Constraint, fingerprint, Limits)       -> ("ok", TokenAutomaton) | ("error", msg)
                                                          | ("missing", fingerprint)

It keeps the VOCABULARIES_KEPT vocabularies used last; asked to compile over another, it answers
"missing" and the compiler sends that vocabulary again.

It imports numpy and outlines-core, never JAX.
"""

from __future__ import annotations

import collections
import os
import pickle
import resource
import sys
from typing import Any, BinaryIO

from sbd_jax.constrain.automaton import compile_regex
from sbd_jax.constrain.index import outlines_vocabulary
from sbd_jax.constrain.regexes import constraint_regex
from sbd_jax.constrain.spec import ConstraintError, one_line

VOCABULARIES_KEPT = 4
HEADER_BYTES = 8


def write_message(stream: BinaryIO, message: Any) -> None:
  data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(len(data).to_bytes(HEADER_BYTES, "little") + data)
  stream.flush()


def read_message(stream: BinaryIO) -> Any:
  """The next message, or None at the end of the stream."""
  header = stream.read(HEADER_BYTES)
  if len(header) < HEADER_BYTES:
    return None
  return pickle.loads(stream.read(int.from_bytes(header, "little")))


def answer(request: tuple, vocabularies: collections.OrderedDict) -> tuple:
  """The reply to one request."""
  if request[0] == "vocabulary":
    vocabulary = request[1]
    vocabularies[vocabulary.fingerprint] = (vocabulary, outlines_vocabulary(vocabulary))
    while len(vocabularies) > VOCABULARIES_KEPT:
      vocabularies.popitem(last=False)
    return ("ok", None)
  _, constraint, fingerprint, limits = request
  if fingerprint not in vocabularies:
    return ("missing", fingerprint)
  vocabularies.move_to_end(fingerprint)
  vocabulary, outlines_vocab = vocabularies[fingerprint]
  try:
    return ("ok", compile_regex(constraint_regex(constraint), vocabulary, limits, outlines_vocab))
  except ConstraintError as e:
    return ("error", one_line(str(e)))
  except MemoryError:
    return ("error", "the constraint is too large: its compiler ran out of memory")
  except RecursionError:
    return ("error", "the constraint is nested too deeply")


def main() -> None:
  memory = int(sys.argv[1]) if len(sys.argv) > 1 else 0
  if memory > 0:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
  requests, replies = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
  sys.stdout = sys.stderr  # a stray print must not corrupt the replies
  vocabularies: collections.OrderedDict = collections.OrderedDict()
  write_message(replies, ("ready", None))
  while (request := read_message(requests)) is not None:
    write_message(replies, answer(request, vocabularies))


if __name__ == "__main__":
  main()
