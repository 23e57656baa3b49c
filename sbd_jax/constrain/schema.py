"""The JSON-schema subset that compiles, and the schema outlines-core is given.

outlines-core turns a schema into a regex, but it reads only some keywords and ignores the
rest, and a few of its translations do not match JSON Schema's meaning. `inline_schema` accepts
a keyword only where the regex enforces it exactly, so every text the automaton accepts
validates against the original schema; anything else is refused in one line, naming the
keyword and where it stands (a JSON pointer). What is accepted:

* annotations (title, description, default, examples, $comment, $schema, $id, deprecated,
  readOnly, writeOnly) anywhere; they are dropped;
* `type` (a name or a list of names) with: strings' minLength / maxLength, or pattern (a
  regex over the string's characters that cannot match '"', '\\' or a control character;
  matched whole), or format "uuid"; arrays' items, minItems, maxItems; objects'
  additionalProperties, maxProperties, minProperties up to 1;
* properties (the object's keys in the schema's order, the required ones always), required,
  additionalProperties (no key beyond the listed properties is written);
* enum and const (object keys in them free of regex metacharacters; integers within 64 bits,
  fractions of at most 15 digits and exponents within +-22), anyOf, prefixItems, and allOf /
  oneOf of a single schema;
* $ref to a local definition ("#/$defs/x", "#/definitions/x"); it is inlined, and a reference
  that leads back to itself (a recursive schema) is refused;
* integers' minimum, maximum, exclusiveMinimum, exclusiveMaximum (type "integer" alone): which
  outlines-core ignores, so the integer becomes a placeholder `const` whose regex is replaced by
  the range's (`integers.range_regex`; `Inlined`).

Refused, among others: bounds on "number", multipleOf, uniqueItems,
patternProperties, not, if/then/else, oneOf / allOf of several schemas, the formats whose
outlines-core regexes admit invalid values or broken JSON (date, time, date-time, email, uri).

Where the schema leaves values open ({}, an object without properties, an array without items)
they nest at most OPEN_DEPTH levels (outlines-core's "depth").
"""

from __future__ import annotations

import decimal
import secrets
from typing import Any, NamedTuple

from sbd_jax.constrain import integers
from sbd_jax.constrain.index import END_MARKER, index_transitions, strip_anchors
from sbd_jax.constrain.integers import INTEGER_BOUNDS, range_regex
from sbd_jax.constrain.spec import ConstraintError

ANNOTATIONS = frozenset(
  {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "$schema",
    "$id",
    "deprecated",
    "readOnly",
    "writeOnly",
  }
)
DEFINITIONS = ("$defs", "definitions")
# outlines-core reads the first of these a schema holds and ignores the others.
DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref")
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
FORMATS = ("uuid",)
KEYWORD_TYPE = {
  "minLength": "string",
  "maxLength": "string",
  "pattern": "string",
  "format": "string",
  "items": "array",
  "minItems": "array",
  "maxItems": "array",
  "additionalProperties": "object",
  "minProperties": "object",
  "maxProperties": "object",
}
# outlines-core writes the keys of enum / const objects into the regex unescaped.
KEY_METACHARACTERS = frozenset('\\.+*?()|[]{}^$#&-~"')
MAX_NODES = 20_000  # schema nodes after $ref inlining
MAX_DEPTH = 64
MAX_INT = 2**63 - 1  # outlines-core reads enum / const numbers as 64-bit
MAX_DIGITS, MAX_EXPONENT = 15, 22  # enum / const fractions it reads exactly
# How deep values nest where the schema leaves them open ({}, an object without properties, an
# array without items): outlines-core's "depth" (0: scalars only). Its own default, 2, costs
# seconds to compile (a DFA of ~1600 states); 1 compiles in a fraction of a second.
OPEN_DEPTH = 1


class Inlined(NamedTuple):
  """A schema as outlines-core reads it, and the integer ranges it stands for: each range is a
  `const` string (a key of `integer_ranges`) whose regex is to be replaced by the range's
  (`regexes.constraint_regex`)."""

  schema: dict[str, Any]
  integer_ranges: dict[str, str]


def inline_schema(schema: Any) -> Inlined:
  """The schema without annotations, definitions or $ref (each reference replaced by what it
  names), in the form outlines-core reads; ConstraintError where a keyword is not enforced."""
  inliner = _Inliner(schema)
  return Inlined(inliner.node(schema, "#", ()), inliner.integer_ranges)


def _refuse(message: str) -> ConstraintError:
  return ConstraintError(message)


def _json_type(value: Any) -> str:
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
    return "integer"
  names = {str: "string", float: "number", type(None): "null", list: "array", dict: "object"}
  return names[type(value)]


def _has_type(value: Any, name: str) -> bool:
  found = _json_type(value)
  return found == name or (name == "number" and found == "integer")


def _check_literal(value: Any, where: str) -> None:
  """An enum / const value outlines-core writes exactly."""
  if isinstance(value, dict):
    for key, item in value.items():
      if any(c in KEY_METACHARACTERS or ord(c) < 0x20 for c in key):
        raise _refuse(f"object key {key!r} in the enum / const at {where} is not supported")
      _check_literal(item, where)
  elif isinstance(value, list):
    for item in value:
      _check_literal(item, where)
  elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
    raise _refuse(f"integer {value} at {where} is outside the 64-bit range")
  elif isinstance(value, float):
    # outlines-core reads numbers with serde_json's fast parser, exact only where a float is
    # its digits times or over a power of ten that are both exact in float64 (Clinger's fast
    # path); elsewhere it may round the last digit.
    exact = decimal.Decimal(repr(value)).as_tuple()
    if len(exact.digits) > MAX_DIGITS or abs(exact.exponent) > MAX_EXPONENT:
      raise _refuse(f"number {value!r} at {where} has more digits than outlines-core reads exactly")


def _count(value: Any, keyword: str, where: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise _refuse(f"{keyword} at {where} must be a non-negative integer")
  return value


def _bounds(obj: dict, low: str, high: str, where: str) -> dict[str, int]:
  out = {k: _count(obj[k], k, where) for k in (low, high) if k in obj}
  if out.get(low, 0) > out.get(high, out.get(low, 0)):
    raise _refuse(f"{low} > {high} at {where}")
  return out


def _types(value: Any, where: str) -> list[str]:
  names = [value] if isinstance(value, str) else value
  if not isinstance(names, list) or not names or len(set(map(str, names))) < len(names):
    raise _refuse(f"type at {where} must be a type name or a list of distinct names")
  unknown = [n for n in names if n not in TYPES]
  if unknown:
    raise _refuse(f"type {unknown[0]!r} at {where} is not a JSON-schema type")
  return names


def check_string_pattern(pattern: Any, where: str) -> str:
  """The pattern as a group outlines-core puts between the string's quotes; refused when it is
  not a regex, matches nothing, or can match a character that JSON must escape."""
  from outlines_core import Vocabulary

  if not isinstance(pattern, str):
    raise _refuse(f"pattern at {where} must be a string")
  spellable = {bytes([b]): [b] for b in range(256)}
  spellable[END_MARKER.encode("utf-8")] = [257]
  what = f"pattern {pattern!r} at {where}"
  transitions, _, _ = index_transitions(pattern, Vocabulary(256, spellable), 257, 256, what)
  escaped = {ord('"'), ord("\\"), *range(0x20)}
  if any(escaped & moves.keys() for moves in transitions.values()):
    raise _refuse(
      f"{what} can match '\"', '\\' or a control character, which a JSON string must escape"
    )
  return f"(?:{strip_anchors(pattern)})"


class _Inliner:
  """Walks a schema once, following references; counts the nodes it writes."""

  def __init__(self, root: Any):
    self.root = root
    self.nodes = 0
    self.depth = 0
    self.integer_ranges: dict[str, str] = {}
    self.nonce = secrets.token_hex(8)  # no string in a schema is a placeholder by chance

  def node(self, schema: Any, where: str, refs: tuple[str, ...]) -> dict[str, Any]:
    self.nodes += 1
    if self.nodes > MAX_NODES or self.depth >= MAX_DEPTH:
      raise _refuse(f"the schema is too large: over {MAX_NODES} nodes or {MAX_DEPTH} levels")
    self.depth += 1
    try:
      return self._node(schema, where, refs)
    finally:
      self.depth -= 1

  def _node(self, schema: Any, where: str, refs: tuple[str, ...]) -> dict[str, Any]:
    if schema is True:
      return {"type": list(TYPES), "depth": OPEN_DEPTH}
    if schema is False:
      raise _refuse(f"the schema at {where} is false: it admits no value")
    if not isinstance(schema, dict):
      raise _refuse(f"the schema at {where} must be an object")
    for name in DEFINITIONS:
      if name in schema and not isinstance(schema[name], dict):
        raise _refuse(f"{name} at {where} must be an object")
    kept = {k: v for k, v in schema.items() if k not in ANNOTATIONS and k not in DEFINITIONS}
    kinds = [k for k in DISPATCH if k in kept]
    if len(kinds) > 1:
      raise _refuse(f"{kinds[0]} together with {kinds[1]} at {where} is not supported")
    if kinds:
      return getattr(self, "_" + kinds[0].lstrip("$"))(kept, where, refs)
    if "type" in kept:
      return self._type(kept, where, refs)
    if kept:
      raise _unsupported(next(iter(kept)), where)
    return {"type": list(TYPES), "depth": OPEN_DEPTH}

  def _only(self, kept: dict, allowed: set[str], where: str) -> None:
    extra = [k for k in kept if k not in allowed]
    if extra:
      raise _unsupported(extra[0], where)

  def _properties(self, kept: dict, where: str, refs) -> dict[str, Any]:
    self._only(kept, {"properties", "required", "type", "additionalProperties"}, where)
    if "type" in kept and "object" not in _types(kept["type"], where):
      raise _refuse(f"properties at {where} need type object")
    properties, required = kept["properties"], kept.get("required", [])
    if not isinstance(properties, dict):
      raise _refuse(f"properties at {where} must be an object")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
      raise _refuse(f"required at {where} must be a list of property names")
    missing = [r for r in required if r not in properties]
    if missing:
      raise _refuse(f"required property {missing[0]!r} at {where} is not in its properties")
    extra = kept.get("additionalProperties", True)
    if not isinstance(extra, bool):
      self.node(extra, f"{where}/additionalProperties", refs)  # checked; no extra key is written
    out = {}
    for name, sub in properties.items():
      if any(c in '"\\' or ord(c) < 0x20 for c in name):
        raise _refuse(f"property name {name!r} at {where} needs JSON escapes (not supported)")
      out[name] = self.node(sub, f"{where}/properties/{name}", refs)
    return {"properties": out, **({"required": list(dict.fromkeys(required))} if required else {})}

  def _single(self, kept: dict, key: str, where: str, refs) -> dict[str, Any]:
    self._only(kept, {key}, where)
    schemas = kept[key]
    if not isinstance(schemas, list) or len(schemas) != 1:
      raise _refuse(f"{key} at {where} is supported with one schema only (use anyOf)")
    return self.node(schemas[0], f"{where}/{key}/0", refs)

  def _allOf(self, kept: dict, where: str, refs) -> dict[str, Any]:
    return self._single(kept, "allOf", where, refs)

  def _oneOf(self, kept: dict, where: str, refs) -> dict[str, Any]:
    return self._single(kept, "oneOf", where, refs)

  def _anyOf(self, kept: dict, where: str, refs) -> dict[str, Any]:
    self._only(kept, {"anyOf"}, where)
    schemas = kept["anyOf"]
    if not isinstance(schemas, list) or not schemas:
      raise _refuse(f"anyOf at {where} must be a non-empty list of schemas")
    return {"anyOf": [self.node(s, f"{where}/anyOf/{i}", refs) for i, s in enumerate(schemas)]}

  def _prefixItems(self, kept: dict, where: str, refs) -> dict[str, Any]:
    self._only(kept, {"prefixItems", "type", "items", "minItems", "maxItems"}, where)
    if "type" in kept and "array" not in _types(kept["type"], where):
      raise _refuse(f"prefixItems at {where} need type array")
    schemas = kept["prefixItems"]
    if not isinstance(schemas, list):
      raise _refuse(f"prefixItems at {where} must be a list of schemas")
    bounds = _bounds(kept, "minItems", "maxItems", where)
    if not bounds.get("minItems", 0) <= len(schemas) <= bounds.get("maxItems", len(schemas)):
      raise _refuse(f"minItems / maxItems at {where} exclude the {len(schemas)} prefixItems")
    if not isinstance(kept.get("items", False), bool):
      self.node(kept["items"], f"{where}/items", refs)  # checked; no item past the prefix
    items = [self.node(s, f"{where}/prefixItems/{i}", refs) for i, s in enumerate(schemas)]
    return {"prefixItems": items}

  def _literals(self, kept: dict, key: str, values: list, where: str) -> None:
    self._only(kept, {key, "type"}, where)
    names = _types(kept["type"], where) if "type" in kept else None
    for value in values:
      _check_literal(value, f"{where}/{key}")
      if names is not None and not any(_has_type(value, n) for n in names):
        raise _refuse(f"{key} value {value!r} at {where} is not of its type {kept['type']}")

  def _enum(self, kept: dict, where: str, refs) -> dict[str, Any]:
    values = kept["enum"]
    if not isinstance(values, list) or not values:
      raise _refuse(f"enum at {where} must be a non-empty list")
    self._literals(kept, "enum", values, where)
    return {"enum": values}

  def _const(self, kept: dict, where: str, refs) -> dict[str, Any]:
    self._literals(kept, "const", [kept["const"]], where)
    return {"const": kept["const"]}

  def _ref(self, kept: dict, where: str, refs) -> dict[str, Any]:
    self._only(kept, {"$ref"}, where)
    ref = kept["$ref"]
    if not isinstance(ref, str) or not ref.startswith("#") or any(c in ref for c in "~%"):
      raise _refuse(f"$ref {ref!r} at {where} is not a local reference ('#/$defs/name')")
    if ref in refs:
      raise _refuse(f"$ref {ref!r} at {where} is recursive (not supported)")
    target = self.root
    for part in (p for p in ref[1:].split("/") if p):
      if not isinstance(target, dict) or part not in target:
        raise _refuse(f"$ref {ref!r} at {where} names nothing in the schema")
      target = target[part]
    return self.node(target, ref, (*refs, ref))

  def _type(self, kept: dict, where: str, refs) -> dict[str, Any]:
    names = _types(kept["type"], where)
    for key in kept:
      if key != "type" and key not in KEYWORD_TYPE and key not in INTEGER_BOUNDS:
        raise _unsupported(key, where)
    if any(key in kept for key in INTEGER_BOUNDS):
      return self._integer_range(kept, names, where)
    if "required" in kept:
      raise _refuse(f"required without properties at {where} is not supported")
    out: dict[str, Any] = {"type": kept["type"], "depth": OPEN_DEPTH}
    if "string" in names:
      out.update(_string_keywords(kept, where))
    if "array" in names:
      out.update(_bounds(kept, "minItems", "maxItems", where))
      if kept.get("items") is False:  # no item at all
        if out.get("minItems", 0):
          raise _refuse(f"items false with minItems at {where}: no array")
        out["maxItems"] = 0
      elif "items" in kept:
        out["items"] = self.node(kept["items"], f"{where}/items", refs)
    if "object" in names:
      out.update(self._object_keywords(kept, where, refs))
    return out

  def _integer_range(self, kept: dict, names: list[str], where: str) -> dict[str, Any]:
    """An integer with bounds: a placeholder `const` (`Inlined`) for the range's regex."""
    if names != ["integer"]:
      raise _refuse(f"minimum / maximum at {where} are supported on type 'integer' alone")
    try:
      pattern = range_regex(*integers.bounds({k: kept[k] for k in INTEGER_BOUNDS if k in kept}))
    except ValueError as e:
      raise _refuse(f"{e} at {where}") from None
    placeholder = f"sbd-integer-range-{len(self.integer_ranges)}-{self.nonce}"
    self.integer_ranges[placeholder] = pattern
    return {"const": placeholder}

  def _object_keywords(self, kept: dict, where: str, refs) -> dict[str, Any]:
    out: dict[str, Any] = _bounds(kept, "minProperties", "maxProperties", where)
    if out.get("minProperties", 0) > 1:
      raise _refuse(f"minProperties above 1 at {where} is not supported (keys may repeat)")
    extra = kept.get("additionalProperties", True)
    if extra is False:
      if out.get("minProperties", 0):
        raise _refuse(f"additionalProperties false with minProperties at {where}: no object")
      out["maxProperties"] = 0
    elif extra is not True:
      out["additionalProperties"] = self.node(extra, f"{where}/additionalProperties", refs)
    return out


def _string_keywords(kept: dict, where: str) -> dict[str, Any]:
  groups = [g for g in ("length", "pattern", "format") if _has_group(kept, g)]
  if len(groups) > 1:
    raise _refuse(f"{groups[0]} together with {groups[1]} at {where} is not supported")
  out: dict[str, Any] = _bounds(kept, "minLength", "maxLength", where)
  if "pattern" in kept:
    out["pattern"] = check_string_pattern(kept["pattern"], where)
  if "format" in kept:
    if kept["format"] not in FORMATS:
      raise _refuse(f"format {kept['format']!r} at {where} is not supported (only uuid)")
    out["format"] = kept["format"]
  return out


def _has_group(kept: dict, group: str) -> bool:
  return (group == "length" and ("minLength" in kept or "maxLength" in kept)) or group in kept


def _unsupported(keyword: str, where: str) -> ConstraintError:
  return _refuse(f"JSON-schema keyword {keyword!r} at {where} is not supported")
