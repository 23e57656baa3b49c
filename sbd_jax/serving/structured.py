"""Structured output at the server: the constraint a request asks for, and its automaton
compiled off the event loop.

    response_format     {"type": "text"}: none; {"type": "json_object"}: any JSON object
                        (`Constraint.json_object()`); {"type": "json_schema", "json_schema":
                        {"name", "description", "schema", "strict"}}: the schema
    structured_outputs  vLLM's, one of {"json": a schema or its JSON text}, {"regex": str},
                        {"choice": [str, ...]}, {"json_object": true}

At most one constraint a request: both fields asking for one is refused, and so is any other
type or key (a grammar, whitespace options), in one line naming the field. `strict` may be
anything: the schema is always enforced. A constraint is compiled by the server's
`ConstraintCompiler` (a worker process bounded in time and size; `constrain.compiler`) while
the event loop serves other clients; a constraint it has cached (refusals included) is answered
without waiting behind another's compile, and at most `max_pending` compiles wait at once (more
get 503). An automaton larger than a pool's table set (`pool_tables.Capacity`) is refused with
the flags that size it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from sbd_jax.constrain.compiler import ConstraintCompiler
from sbd_jax.constrain.spec import Constraint, ConstraintError
from sbd_jax.constrain.vocabulary import TokenVocabulary
from sbd_jax.decode import automata
from sbd_jax.decode.settings import TRACED_CONSTRAINT
from sbd_jax.serving.pool_tables import Capacity
from sbd_jax.serving.protocol import BadRequest
from sbd_jax.serving.requests import QueueFull

FORMATS = ("text", "json_object", "json_schema")
OUTPUTS = ("json", "regex", "choice", "json_object")
JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")
MAX_PENDING = 16  # compiles that may wait at once


@dataclasses.dataclass
class StructuredOutput:
  """What a server compiles constraints with: its compiler and the model's vocabulary (with
  the run's EOS and mask: `decode.automata.vocabulary`)."""

  compiler: ConstraintCompiler
  vocabulary: TokenVocabulary
  max_pending: int = MAX_PENDING
  pending: int = 0  # compiles awaited now (read and written on the event loop only)

  @classmethod
  def of(cls, compiler: ConstraintCompiler, tokenizer, run, vocab_size: int) -> StructuredOutput:
    """Over `tokenizer`'s vocabulary of the model's `vocab_size` logits, with the run's
    (`SamplerSettings`) EOS, mask and pad ids."""
    return cls(compiler, automata.vocabulary(tokenizer, run, vocab_size))

  def warm(self) -> None:
    """Start the compiler's worker and send it the vocabulary (a server does it before its
    port opens); RuntimeError if the worker does not start."""
    try:
      self.compiler.compile(TRACED_CONSTRAINT, self.vocabulary)
    except ConstraintError:  # the worker answered: it runs and holds the vocabulary
      pass

  async def automaton(self, constraint: Constraint, field: str, capacity: Capacity):
    """`constraint`'s automaton, compiled on the compiler's thread and worker; BadRequest (one
    line, naming `field`) for a constraint that is invalid, unsupported or larger than
    `capacity`, QueueFull while `max_pending` compiles wait."""
    try:
      found = self.compiler.lookup(constraint, self.vocabulary)
      if found is None:
        if self.pending >= self.max_pending:
          raise QueueFull(f"{self.pending} constraints are compiling; retry later")
        self.pending += 1
        try:
          found = await asyncio.wrap_future(self.compiler.submit(constraint, self.vocabulary))
        finally:
          self.pending -= 1
      capacity.check(found)
    except ConstraintError as e:
      raise BadRequest(f"{field}: {e}", param=field) from None
    return found


def constraint_of(body, structured: StructuredOutput | None) -> tuple[Constraint | None, str]:
  """(the constraint `body` asks for, or None; the field that asks for it). BadRequest for an
  unsupported or invalid one, two, or any where the server runs without structured output
  (`structured` None)."""
  asked = []
  if body.response_format is not None:
    asked.append((_response_format(body.response_format), "response_format"))
  if body.structured_outputs is not None:
    asked.append((_structured_outputs(body.structured_outputs), "structured_outputs"))
  asked = [(c, field) for c, field in asked if c is not None]
  if len(asked) > 1:
    raise BadRequest(
      "response_format and structured_outputs both ask for a constraint: give one",
      param="structured_outputs",
    )
  if not asked:
    return None, ""
  constraint, field = asked[0]
  if structured is None:
    raise BadRequest(
      f"{field}: this server runs without structured output (--nostructured_output)", param=field
    )
  return constraint, field


def _response_format(value: Any) -> Constraint | None:
  """OpenAI's `response_format` as a constraint (None for text)."""
  field = "response_format"
  _keys(value, field, ("type", "json_schema"))
  kind = value.get("type")
  if kind not in FORMATS:
    raise BadRequest(
      f"{field}.type {_shown(kind)} is not supported (one of {', '.join(FORMATS)})", param=field
    )
  spec = value.get("json_schema")
  if kind != "json_schema":
    if spec is not None:
      raise BadRequest(f"{field}.json_schema is only allowed with type 'json_schema'", param=field)
    return Constraint.json_object() if kind == "json_object" else None
  _keys(spec, f"{field}.json_schema", JSON_SCHEMA_FIELDS)
  for name, types in (("name", str), ("description", str), ("strict", bool)):
    if spec.get(name) is not None and not isinstance(spec[name], types):
      raise BadRequest(f"{field}.json_schema.{name} must be a {types.__name__}", param=field)
  if not isinstance(spec.get("schema"), dict):
    raise BadRequest(f"{field}.json_schema.schema: give the JSON schema, an object", param=field)
  return _made(Constraint.json_schema, spec["schema"], f"{field}.json_schema.schema")


def _structured_outputs(value: Any) -> Constraint | None:
  """vLLM's `structured_outputs` as a constraint (None where it asks for nothing: its keys
  null or false)."""
  field = "structured_outputs"
  if not isinstance(value, dict):
    raise BadRequest(f"{field} must be an object", param=field)
  given = {k: v for k, v in value.items() if v is not None and v is not False}
  for key in given:
    if key not in OUTPUTS:
      raise BadRequest(
        f"{field}.{_shown(key, quote=False)} is not supported (one of {', '.join(OUTPUTS)})",
        param=field,
      )
  if len(given) > 1:
    raise BadRequest(f"{field}: give one of {', '.join(OUTPUTS)}, not {len(given)}", param=field)
  if not given:
    return None
  ((key, spec),) = given.items()
  where = f"{field}.{key}"
  if key == "json_object":
    if spec is not True:
      raise BadRequest(f"{where} must be true", param=field)
    return Constraint.json_object()
  if key == "json" and not isinstance(spec, dict | str):
    raise BadRequest(f"{where}: give a JSON schema (an object, or its JSON text)", param=field)
  make = {"json": Constraint.json_schema, "regex": Constraint.regex, "choice": Constraint.choice}
  return _made(make[key], spec, where)


def _made(make, spec, where: str) -> Constraint:
  field = where.split(".")[0]
  try:
    return make(spec)
  except ConstraintError as e:
    raise BadRequest(f"{where}: {e}", param=field) from None


def _keys(value: Any, where: str, known: tuple[str, ...]) -> None:
  """BadRequest unless `value` is an object of `known` keys."""
  field = where.split(".")[0]
  if not isinstance(value, dict):
    raise BadRequest(f"{where} must be an object", param=field)
  for key in value:
    if key not in known:
      raise BadRequest(f"{where}: unknown field {_shown(key)}", param=field)


def _shown(value: Any, quote: bool = True, most: int = 40) -> str:
  """A client's value in a message: short, on one line."""
  text = repr(value) if quote else str(value)
  text = " ".join(text.split())
  return text if len(text) <= most else text[: most - 3] + "..."
