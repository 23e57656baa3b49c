"""outlines-core's token index, made complete by compiling each regex with an end marker.

outlines-core 0.2.14 (the newest release) drops a transition into a DFA state that
regex-automata marks as a match when the text read is not itself a match: its DFAs report a
match one byte late, so that state's text minus its last byte is a match. After "a" in
`a(bc)?` the byte "b" is lost; over a byte vocabulary `[0-9]+(\\.[0-9]+)?` never writes a
decimal point. (Fixed upstream after the release: commit 2ba0b24, "fix: avoid generating
incomplete automata".) A regex R is therefore compiled as `(?:R)` followed by an end marker,
U+10FFFF (a noncharacter), with one extra token that spells the marker: no text without the
marker is a match, so every transition stays; a state is final where the marker's token leads
to a final state of the index, and the marker's token and the states past it are dropped. Only
a text that holds U+10FFFF itself, and goes on after a point where R could end, can still lose
a transition.

The marker needs R's end free of anchors and R one group: a leading '^' and a trailing '$' are
dropped (a pattern is matched whole anyway); a '$' or '\\z' anywhere else, unbalanced
parentheses and the verbose flag are refused (`unsupported_syntax`).
"""

from __future__ import annotations

import collections
import re

from sbd_jax.constrain.spec import ConstraintError, one_line

END_MARKER = "\U0010ffff"
END_MARKER_REGEX = r"\x{10FFFF}"


def outlines_vocabulary(vocabulary):
  """outlines-core's `Vocabulary` of a `TokenVocabulary`: each byte string with the ids that
  decode to it, and the end marker as id `vocabulary.vocab_size`."""
  from outlines_core import Vocabulary

  ids_of = collections.defaultdict(list)
  for i, data in enumerate(vocabulary.token_bytes):
    if data is not None:
      ids_of[data].append(i)
  ids_of[END_MARKER.encode("utf-8")].append(vocabulary.vocab_size)
  return Vocabulary(vocabulary.eos_id, dict(ids_of))


def strip_anchors(pattern: str) -> str:
  """The pattern without a leading '^' and an unescaped trailing '$'."""
  core = pattern[1:] if pattern.startswith("^") else pattern
  if core.endswith("$"):
    backslashes = len(core[:-1]) - len(core[:-1].rstrip("\\"))
    if backslashes % 2 == 0:
      core = core[:-1]
  return core


def unsupported_syntax(pattern: str) -> str | None:
  """What keeps `pattern` from being wrapped as `(?:pattern)` and followed by the marker: a
  '$' or '\\z' outside a character class, unbalanced parentheses, or the verbose flag (whose
  comments could hide either); None if nothing does."""
  depth, groups, i = 0, 0, 0
  while i < len(pattern):
    c = pattern[i]
    if c == "\\":
      if pattern[i + 1 : i + 2] == "z" and depth == 0:
        return "'\\z' before its end"
      i += 2
      continue
    if c == "[":
      depth += 1
      i += 1 + (pattern[i + 1 : i + 2] == "^")
      i += pattern[i : i + 1] == "]"  # a leading ']' is a literal
      continue
    if c == "]" and depth:
      depth -= 1
    elif depth == 0 and c == "$":
      return "'$' before its end"
    elif depth == 0 and c == "(":
      groups += 1
      flags = re.match(r"\(\?([a-zA-Z-]*)[:)]", pattern[i:])
      if flags and "x" in flags.group(1):
        return "the verbose flag (x)"
    elif depth == 0 and c == ")":
      groups -= 1
      if groups < 0:
        return "an unbalanced ')'"
    i += 1
  return "an unbalanced '('" if groups else None


def index_transitions(regex: str, outlines_vocab, end_id: int, eos_id: int, what: str):
  """({state: {token: next}}, initial state, final states) of `regex` over an outlines
  vocabulary from `outlines_vocabulary` (`end_id`: its marker's id), EOS from each final state
  to itself, as outlines-core's own index writes it."""
  from outlines_core import Index

  core = strip_anchors(regex)
  problem = unsupported_syntax(core)
  if problem is not None:
    raise ConstraintError(f"the {what}'s regex holds {problem} (not supported)")
  try:
    index = Index(f"(?:{core}){END_MARKER_REGEX}", outlines_vocab)
  except ValueError as e:
    text = str(e)
    if "incompatible with the regex" in text:
      raise ConstraintError(f"the {what} admits no text this vocabulary can spell") from None
    message = f"the {what}'s regex does not compile ({text}): lookaround, backreferences and "
    raise ConstraintError(one_line(message + "Unicode word boundaries are not supported")) from None
  raw, raw_finals = index.get_transitions(), set(index.get_final_states())
  finals = {s for s, moves in raw.items() if moves.get(end_id, -1) in raw_finals}
  transitions = {
    s: {t: n for t, n in moves.items() if t != end_id and t != eos_id} for s, moves in raw.items()
  }
  for s in finals:
    transitions[s][eos_id] = s
  return transitions, index.get_initial_state(), finals
