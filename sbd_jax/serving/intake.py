"""A request body, from its bytes to a validated request (`protocol`), each step bounded before
the next does work per item: parsing and validating run on the event loop, which serves every
client, so no body under --max_body_bytes may hold it for long.

1. Its JSON items (elements of arrays and members of objects) are counted at C speed
   (`json_items`), and a body with more than the largest request the server takes holds
   (`max_items`) is refused before it is parsed.
2. The parsed lists are counted (`check_lengths`): more choices (prompts x n) than
   --max_queue, more token ids or messages (or content parts) than --max_prompt_tokens, more
   stop strings than `protocol.MAX_STOPS`, before a single item is validated.
3. pydantic validates the fields.

Each refusal is a one-line `protocol.BadRequest` (400).
"""

from __future__ import annotations

import json

import pydantic

from sbd_jax.serving import protocol
from sbd_jax.serving.protocol import BadRequest, Limits

# Items a request may hold besides its prompts and messages (its other fields, stop strings,
# stop token ids, stream options): a generous count.
_OTHER_ITEMS = 8


def max_items(limits: Limits, max_queue: int) -> int:
  """The most JSON items a request the server takes can hold: --max_queue prompts of
  --max_prompt_tokens token ids (each id an item, each prompt one more), or a chat of
  --max_prompt_tokens messages and content parts (a handful of items each), and the other
  fields."""
  return (max_queue + _OTHER_ITEMS) * (limits.max_prompt_tokens + _OTHER_ITEMS)


def json_items(body: bytes, most: int) -> int:
  """An upper bound on the JSON items in `body`: its commas and opening brackets outside
  strings, counted with bytes methods. Past 2 x `most` strings, half their number (each item
  holds at most two), so that splitting the body at its quotes costs at most that many
  pieces."""
  body = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # no escaped quote ends a string
  strings = body.count(b'"') // 2
  if strings > 2 * most:
    return strings // 2
  outside = b"".join(body.split(b'"')[::2])
  return outside.count(b",") + outside.count(b"[") + outside.count(b"{")


def parse(body: bytes, content_type: str | None, model: type[pydantic.BaseModel],
          limits: Limits, max_queue: int):  # fmt: skip
  """`body` as a validated `model` (a `protocol` request); BadRequest, with pydantic's first
  error as one line, for anything else."""
  media = (content_type or "").split(";")[0].strip().lower()
  if media != "application/json" and not media.endswith("+json"):
    raise BadRequest("the body must be JSON (Content-Type: application/json)")
  most = max_items(limits, max_queue)
  items = json_items(body, most)
  if items > most:
    raise BadRequest(
      f"the body holds {items} JSON items, more than any request this server takes "
      f"({most}: --max_queue prompts of --max_prompt_tokens token ids, and the other fields)"
    )
  try:
    data = json.loads(body)
  except RecursionError:
    raise BadRequest("malformed JSON body: nested too deeply") from None
  except ValueError:  # (invalid UTF-8 included)
    raise BadRequest("malformed JSON body") from None
  if not isinstance(data, dict):
    raise BadRequest("the body must be a JSON object")
  check_lengths(data, limits, max_queue)
  try:
    return model.model_validate(data)
  except pydantic.ValidationError as e:
    raise BadRequest(validation_message(e)) from None


def check_lengths(data: dict, limits: Limits, max_queue: int) -> None:
  """Refuse lists longer than the server takes, by their lengths alone."""
  max_tokens = limits.max_prompt_tokens
  prompt, prompts = data.get("prompt"), 1
  if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
    prompts = len(prompt)
  elif isinstance(prompt, list) and len(prompt) > max_tokens:
    raise BadRequest(protocol.too_many_tokens(len(prompt), max_tokens))
  n = data.get("n")
  n = n if isinstance(n, int) and 1 <= n <= protocol.MAX_N else 1
  protocol.check_choices(prompts * n, max_queue)
  messages = data.get("messages")
  if isinstance(messages, list):
    if len(messages) > max_tokens:
      raise BadRequest(
        f"messages: {len(messages)} messages, more than the server's "
        f"--max_prompt_tokens={max_tokens} (a message is a token at least)"
      )
    contents = [m.get("content") for m in messages if isinstance(m, dict)]
    parts = sum(len(c) for c in contents if isinstance(c, list))
    if parts > max_tokens:
      raise BadRequest(
        f"messages: {parts} content parts, more than the server's --max_prompt_tokens={max_tokens}"
      )
  stop = data.get("stop")
  if isinstance(stop, list) and len(stop) > protocol.MAX_STOPS:
    raise BadRequest(protocol.STOPS_BOUND)


def validation_message(error: pydantic.ValidationError) -> str:
  """pydantic's first error as one line naming the field."""
  first = error.errors()[0]
  where = ".".join(str(x) for x in first.get("loc", ()))
  if first.get("type") == "extra_forbidden":
    return f"unknown field {where!r}"
  message = " ".join(str(first.get("msg")).split())
  return f"{where}: {message}" if where else message
