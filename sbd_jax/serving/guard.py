"""What every HTTP request passes through first and last: a pure ASGI middleware inside the
application (`app.create_app`).

- Its id: the client's X-Request-Id when that is 1 to 128 characters of [A-Za-z0-9._:-], else
  a new one (any other text could forge lines of the log); every response carries it.
- Its headers: a request line and header block over `MAX_HEADER_BYTES` gets 431.
- The API key: /v1 without exactly "Authorization: Bearer <key>" (when one is set) gets 401.
- Its body, read whole before the application parses it: over `max_body_bytes` it gets 413,
  by its Content-Length before a byte is read or, sent in chunks, once the bytes received
  pass the limit. The 413 is sent once the rest of the body has been read and dropped (up to
  `DISCARD_BYTES` and `DISCARD_S`), so that a client that writes its whole body before it reads
  reads the 413, not a reset connection (nginx's lingering close).
- An exception the application did not handle: 500 in OpenAI's shape, its traceback logged.
- One line in the access log (logger `sbd_jax.serve.access`), whatever its status, with the
  client's address: a client that left before the response began is logged with status 499
  (nginx's "client closed request"); one that left during a stream, with the status sent and
  its choices `cancelled`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import re
import time
import urllib.parse
import uuid

from starlette.datastructures import Headers

from sbd_jax.serving import shapes

access_log = logging.getLogger("sbd_jax.serve.access")
log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20  # the default: a prompt list at --max_queue x a long prompt fits
MAX_HEADER_BYTES = 16 * 2**10  # the request line and headers (uvicorn's h11 parser's bound)
# A body refused for its size is read and dropped up to this many bytes in all, for at most
# this many seconds, before its 413 is sent; a larger one is answered at once.
DISCARD_BYTES, DISCARD_S = 64 * 2**20, 10.0
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
CLIENT_LEFT = 499  # the status logged for a client that left before the response began


def request_id(given: str | None) -> str:
  """The client's id when it is safe to print and to return; else a new one."""
  return given if given is not None and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


@dataclasses.dataclass
class Record:
  """What the access log says of one request; a decode fills in its part (`decoded`)."""

  id: str
  method: str
  path: str
  client: str = "-"  # host:port
  arrival: float = dataclasses.field(default_factory=time.monotonic)
  status: int | None = None  # as sent
  client_left: bool = False
  decode: str = ""  # finish reasons, tokens, forwards, TTFT

  def decoded(self, reasons: list[str], usage: dict, ttft_s: float) -> None:
    self.decode = (
      f" finish={','.join(dict.fromkeys(reasons))} prompt_tokens={usage['prompt_tokens']} "
      f"completion_tokens={usage['completion_tokens']} forwards={usage['forwards']} "
      f"rollbacks={usage['rollbacks']}{_accepted(usage)} ttft_s={ttft_s:.4f}"
    )

  def line(self) -> str:
    status = self.status or (CLIENT_LEFT if self.client_left else 500)
    path = urllib.parse.quote(self.path[:200], safe="/:@!$&'()*+,;=-._~")
    latency = time.monotonic() - self.arrival
    return (
      f"request={self.id} client={self.client} method={self.method} path={path} "
      f"status={status}{self.decode} "
      f"latency_s={latency:.4f}"
    )


class Guard:
  """The middleware: `app` behind the request's id, key and body checks, and its log line."""

  def __init__(self, app, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = Headers(scope=scope)
    record = Record(
      request_id(headers.get("x-request-id")), scope["method"], scope["path"], _client(scope)
    )
    scope.setdefault("state", {})["access"] = record

    async def send_with_id(message):
      if message["type"] == "http.response.start":
        record.status = None if record.client_left else message["status"]
        message = {
          **message,
          "headers": [*message["headers"], (b"x-request-id", record.id.encode())],
        }
      await send(message)

    try:
      reply = self._refusal(scope, headers) or await self._body(receive, record, headers)
      if isinstance(reply, bytes):
        await self.app(scope, _replay(reply, receive, record), send_with_id)
      elif reply is not None:  # (None: the client left)
        await reply(scope, receive, send_with_id)
    except Exception:
      log.exception("request %s failed", record.id)
      if record.status is None:
        reply = shapes.error(500, "the server failed: see its log", "server_error")
        await reply(scope, receive, send_with_id)
    finally:
      access_log.info(record.line())

  def _refusal(self, scope, headers):
    """An answer before the body is read: 431 for headers over the bound, 401 without the
    key."""
    head = sum(len(k) + len(v) for k, v in scope["headers"])
    head += len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    if head > MAX_HEADER_BYTES:
      message = f"the request line and headers are larger than {MAX_HEADER_BYTES} bytes"
      return shapes.error(431, message)
    if self.api_key and scope["path"].startswith("/v1"):
      given = headers.get("authorization", "").encode()
      if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
        message = "missing or wrong API key (Authorization: Bearer <key>)"
        return shapes.error(401, message, "auth_error")
    return None

  def _too_large(self):
    message = f"the request body is larger than the server's --max_body_bytes={self.max_body_bytes}"
    return shapes.error(413, message)

  async def _body(self, receive, record: Record, headers):
    """The whole body (bytes); a 413 response for one over the limit; None if the client
    left."""
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > self.max_body_bytes:
      # A client that waits for "100 Continue" has sent nothing yet; one that announces more
      # than is read and dropped would see the connection closed on it anyway.
      if "100-continue" in headers.get("expect", "").lower() or int(length) > DISCARD_BYTES:
        return self._too_large()
      return await self._discard(receive, record, 0, more=True)
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        record.client_left = True
        return None
      chunk = message.get("body", b"")
      size += len(chunk)
      if size > self.max_body_bytes:
        return await self._discard(receive, record, size, message.get("more_body", False))
      chunks.append(chunk)
      if not message.get("more_body", False):
        return b"".join(chunks)

  async def _discard(self, receive, record: Record, received: int, more: bool):
    """The 413 of a body over the limit, once the rest of it is read and dropped: up to
    `DISCARD_BYTES` in all, for up to `DISCARD_S` seconds (then the 413 goes anyway); None if
    the client left."""
    try:
      async with asyncio.timeout(DISCARD_S):
        while more and received <= DISCARD_BYTES:
          message = await receive()
          if message["type"] == "http.disconnect":
            record.client_left = True
            return None
          received += len(message.get("body", b""))
          more = message.get("more_body", False)
    except TimeoutError:
      pass
    return self._too_large()


def _replay(body: bytes, receive, record: Record):
  """A receive that gives the application the body read, then the client's messages (its
  disconnection, noted in the record)."""
  pending = [{"type": "http.request", "body": body, "more_body": False}]

  async def replay():
    if pending:
      return pending.pop()
    message = await receive()
    if message["type"] == "http.disconnect":
      record.client_left = True
    return message

  return replay


def _client(scope) -> str:
  client = scope.get("client")
  return f"{client[0]}:{client[1]}" if client else "-"


def _accepted(usage: dict) -> str:
  """` accepted=A/D`: verified SBD's accepted drafted tokens of those it drafted; else ""."""
  spec = usage.get("spec_decode")
  return (
    "" if spec is None else f" accepted={spec['num_accepted_tokens']}/{spec['num_draft_tokens']}"
  )
