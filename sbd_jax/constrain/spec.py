"""What a constrained decode must produce: one frozen, hashable `Constraint`.

Four kinds, each compiled to one regex (`regexes.constraint_regex`) and from there to a token
automaton by outlines-core:

* `regex`: the whole output matches the pattern (Rust `regex` syntax, as outlines-core reads
  it: no lookaround, no backreferences, no Unicode word boundaries).
* `json_schema`: the output is JSON that validates against the schema: the subset of OpenAI's
  `json_schema` response format that outlines-core enforces exactly (`schema`).
* `json_object`: any JSON object, nested at most `depth` levels (values of an object at depth
  0 are strings, numbers, booleans or null; at depth 1 also arrays and objects of those). A
  finite automaton cannot count brackets without bound, so the depth is part of the
  constraint. The default, 1, compiles in a fraction of a second; 2 (outlines-core's own bound
  for {"type": "object"}) is a DFA of ~1600 states that takes seconds.
* `choice`: exactly one of the given strings.

Constructors check the argument's type and size only; the deep checks (the schema's keywords,
the regex's syntax) run where it compiles, and fail with a one-line `ConstraintError`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

KINDS = ("regex", "json_schema", "json_object", "choice")
MAX_MESSAGE_CHARS = 300
MAX_SOURCE_CHARS = 1 << 20  # a regex, a schema's JSON or the choices' JSON
MAX_OBJECT_DEPTH = 3


class ConstraintError(ValueError):
  """A constraint that is invalid, unsupported or too large to compile (one-line message)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
  """`kind` and its `source`: the regex, the schema as JSON (key order kept: outlines-core
  writes an object's properties in the schema's order), the depth as a decimal string, or the
  choices as a JSON list. Build one with the class methods."""

  kind: str
  source: str

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ConstraintError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
    if not isinstance(self.source, str):
      raise ConstraintError(f"a {self.kind} constraint's source must be a string")
    if len(self.source) > MAX_SOURCE_CHARS:
      raise ConstraintError(
        f"the {self.kind} constraint is {len(self.source)} characters; at most "
        f"{MAX_SOURCE_CHARS} are compiled"
      )

  @classmethod
  def regex(cls, pattern: str) -> Constraint:
    if not isinstance(pattern, str):
      raise ConstraintError(f"a regex must be a string, got {type(pattern).__name__}")
    return cls("regex", pattern)

  @classmethod
  def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
    """A schema as a dict, or as its JSON text."""
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except json.JSONDecodeError as e:
        raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
      except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply") from None
    if not isinstance(schema, dict):
      raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return cls("json_schema", dump_json(schema, "the JSON schema"))

  @classmethod
  def json_object(cls, depth: int = 1) -> Constraint:
    if not isinstance(depth, int) or not 0 <= depth <= MAX_OBJECT_DEPTH:
      raise ConstraintError(f"json_object depth must be an int in [0, {MAX_OBJECT_DEPTH}]")
    return cls("json_object", str(depth))

  @classmethod
  def choice(cls, options: Sequence[str]) -> Constraint:
    if isinstance(options, str) or not isinstance(options, Sequence):
      raise ConstraintError("choices must be a list of strings")
    if not options or not all(isinstance(o, str) for o in options):
      raise ConstraintError("choices must be a non-empty list of strings")
    return cls("choice", dump_json(list(options), "the choices"))

  def choices(self) -> list[str]:
    return json.loads(self.source) if self.kind == "choice" else []

  def schema(self) -> dict[str, Any]:
    return json.loads(self.source) if self.kind == "json_schema" else {}

  def __repr__(self) -> str:
    shown = self.source if len(self.source) <= 60 else self.source[:57] + "..."
    return f"Constraint.{self.kind}({shown!r})"


def one_line(message: str) -> str:
  """`message` on one line, at most MAX_MESSAGE_CHARS long."""
  text = " ".join(message.split())
  return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def dump_json(value: Any, what: str) -> str:
  """Compact JSON of `value`; NaN and infinities are refused (JSON has none)."""
  try:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ConstraintError(f"{what} cannot be written as JSON: {e}") from None
  except RecursionError:
    raise ConstraintError(f"{what} is nested too deeply") from None
