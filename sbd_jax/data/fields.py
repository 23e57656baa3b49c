"""Which fields of a dataset's records are the text, the prompt and completion, or the messages,
and how a message's role and content are named (`data.text_field` and `data.fields`).

The common layouts need a mapping and no code:

    prompt / completion            the defaults
    OpenAI messages                the defaults ({"messages": [{"role", "content"}, ...]})
    ShareGPT conversations         fields.messages=conversations, fields.role=from,
                                   fields.content=value (roles human / gpt: `fields.roles`)
    problem / generated_solution   fields.prompt=problem, fields.completion=generated_solution
    input / output                 fields.prompt=input, fields.completion=output

A record is read as text if it has the text field, else as prompt + completion if it has both,
else as messages; without any, it gets a one-line DataError naming where it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sbd_jax.data.errors import DataError, decode_utf8

Record = dict[str, Any]  # text | prompt + completion | messages


@dataclasses.dataclass(frozen=True)
class FieldMap:
  """Field names of a dataset's records, and role values renamed to the chat template's."""

  text: str = "text"
  prompt: str = "prompt"
  completion: str = "completion"
  messages: str = "messages"
  role: str = "role"
  content: str = "content"
  roles: tuple[tuple[str, str], ...] = (("human", "user"), ("gpt", "assistant"))

  @classmethod
  def of(cls, data_cfg) -> FieldMap:
    """The map a data config sets (`text_field`, `fields`); a config saved before `fields`
    existed reads with the defaults."""
    f = data_cfg.get("fields") or {}
    names = {k: f[k] for k in ("prompt", "completion", "messages", "role", "content") if k in f}
    roles = parse_roles(f["roles"]) if "roles" in f else cls.roles
    return cls(text=data_cfg.get("text_field", "text"), roles=roles, **names)

  @classmethod
  def coerce(cls, fields: FieldMap | str) -> FieldMap:
    """A FieldMap, or the text field's name alone (the other fields at their defaults)."""
    return fields if isinstance(fields, FieldMap) else cls(text=fields)


def parse_roles(spec: str) -> tuple[tuple[str, str], ...]:
  """ "human:user,gpt:assistant" -> (("human", "user"), ("gpt", "assistant"))."""
  pairs = []
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    old, sep, new = item.partition(":")
    if not sep or not old.strip() or not new.strip():
      raise DataError(f"data.fields.roles={spec!r}: expected 'from:to' pairs, e.g. 'gpt:assistant'")
    pairs.append((old.strip(), new.strip()))
  return tuple(pairs)


def parse_record(obj: Any, fields: FieldMap | str, where: str) -> Record:
  """Normalizes a JSON object / TFDS example / parquet row to a record; `where` names it in
  errors."""
  f = FieldMap.coerce(fields)
  if not isinstance(obj, Mapping):
    raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")

  def as_str(key: str) -> str:
    value = obj[key]
    if isinstance(value, bytes):
      return decode_utf8(value, f"{where} field {key!r}")
    if not isinstance(value, str):
      raise DataError(f"{where}: field {key!r} is {type(value).__name__}, expected a string")
    return value

  if f.text in obj:
    return {"text": as_str(f.text)}
  if f.prompt in obj and f.completion in obj:
    return {"prompt": as_str(f.prompt), "completion": as_str(f.completion)}
  if f.messages in obj:
    return {"messages": parse_messages(obj[f.messages], f, where)}
  raise DataError(
    f"{where}: missing field {f.text!r} (or {f.prompt!r} + {f.completion!r}, or {f.messages!r})"
  )


def parse_messages(messages: Any, f: FieldMap, where: str) -> list[dict[str, str]]:
  """A chat record's turns as {"role", "content"}: a non-empty list with at least one assistant
  turn (the only tokens that get a loss), roles renamed by `f.roles`."""
  name = f.messages
  if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
    raise DataError(f"{where}: {name!r} must be a non-empty list of {{role, content}} objects")
  renamed = dict(f.roles)
  parsed = []
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or not isinstance(m.get(f.role), str):
      raise DataError(f"{where}: {name}[{i}] has no string {f.role!r}")
    if not isinstance(m.get(f.content), str):
      raise DataError(f"{where}: {name}[{i}] has no string {f.content!r}")
    parsed.append({"role": renamed.get(m[f.role], m[f.role]), "content": m[f.content]})
  if not any(m["role"] == "assistant" for m in parsed):
    raise DataError(f"{where}: {name!r} has no assistant turn, so nothing to train on")
  return parsed
