"""A constraint as the one regex its automaton is compiled from.

JSON schemas and `json_object` go through outlines-core's `build_regex_from_schema`, with no
whitespace between JSON tokens (compact JSON, still valid JSON: every key, and every
punctuation mark between a value and the next key, is then the only token allowed where it
stands, a forced token); choices are an
alternation of the strings, every character but ASCII letters and digits written as a
`\\x{...}` escape so that no string is read as regex syntax.
"""

from __future__ import annotations

import json

from sbd_jax.constrain.schema import inline_schema
from sbd_jax.constrain.spec import Constraint, ConstraintError, one_line


def escape_literal(text: str) -> str:
  """A regex matching exactly `text` (outlines-core's regex syntax)."""
  return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def schema_regex(schema: dict) -> str:
  """outlines-core's regex for a schema it reads as is (see `schema.inline_schema`)."""
  from outlines_core.json_schema import build_regex_from_schema

  try:
    return build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
  except (ValueError, TypeError) as e:
    raise ConstraintError(one_line(f"outlines-core refused the JSON schema: {e}")) from None


def constraint_regex(constraint: Constraint) -> str:
  """The regex whose full matches are the texts `constraint` allows."""
  if constraint.kind == "regex":
    return constraint.source
  if constraint.kind == "choice":
    return "|".join(f"(?:{escape_literal(c)})" for c in constraint.choices())
  if constraint.kind == "json_object":
    return schema_regex({"type": "object", "depth": int(constraint.source)})
  try:
    inlined = inline_schema(constraint.schema())
  except RecursionError:
    raise ConstraintError("the JSON schema is nested too deeply") from None
  regex = schema_regex(inlined.schema)
  # A range stands where its placeholder does: twice for an array's items, nowhere where the
  # schema leaves no room for it (an array of at most 0 items).
  for placeholder, pattern in inlined.integer_ranges.items():
    regex = regex.replace(schema_regex({"const": placeholder}), pattern)
  return regex
