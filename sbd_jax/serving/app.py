"""The HTTP face of the engine: an OpenAI-compatible FastAPI application.

    POST /v1/completions        prompt(s) -> text; "stream": true sends server-sent events, one
                                chunk per settled block (SBD) or token (NTP)
    POST /v1/chat/completions   messages, rendered by the tokenizer's chat template
    GET  /v1/models, /health

Errors are OpenAI's shape, {"error": {"message": ..., "type": ...}}: 400 for a request that
cannot run (one line naming the field), 503 when the queue is full or the server is draining.
`usage` adds `forwards`: the forwards spent on the request (its NFE, the prefill included).
A client that disconnects cancels its request, which frees its row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

import fastapi
from fastapi import responses
from fastapi.exceptions import RequestValidationError

from sbd_jax.serving import engine as engine_lib
from sbd_jax.serving import protocol


@dataclasses.dataclass
class Served:
  """What the application serves: the engine, the model's tokenizer and chat template, the
  run's decode settings and the server's limits."""

  engine: engine_lib.Engine
  tokenizer: Any
  template: Any  # data.chat.ChatTemplate, or None
  run_settings: Any  # SamplerSettings
  default_mode: str
  limits: protocol.Limits
  model_name: str


class TextStream:
  """A choice's text as its tokens arrive: what may be sent so far, cut at the first stop
  string. Text that could still change (a partial UTF-8 character, a possible start of a stop
  string) is held back until the next tokens settle it."""

  def __init__(self, tokenizer, stops: list[str]):
    self.tokenizer, self.stops = tokenizer, stops
    self.ids: list[int] = []
    self.sent = ""
    self.stopped = False

  def add(self, ids: list[int]) -> str:
    self.ids += ids
    text = self.tokenizer.decode(self.ids)
    hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
    if hits:
      self.stopped = True
      return self._send(text[: min(hits)])
    safe = len(text.rstrip("\ufffd"))
    for stop in self.stops:
      for k in range(min(len(stop) - 1, safe), 0, -1):
        if text[:safe].endswith(stop[:k]):
          safe -= k
          break
    return self._send(text[:safe])

  def finish(self) -> str:
    return "" if self.stopped else self._send(self.tokenizer.decode(self.ids))

  def _send(self, text: str) -> str:
    delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
    self.sent = text if text.startswith(self.sent) else self.sent
    return delta


def _error(
  status: int, message: str, kind: str = "invalid_request_error"
) -> responses.JSONResponse:
  body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
  return responses.JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
  first = exc.errors()[0]
  where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
  if first.get("type") == "json_invalid":
    return "malformed JSON body"
  if first.get("type") == "extra_forbidden":
    return f"unknown field {where!r}"
  return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


def create_app(served: Served) -> fastapi.FastAPI:
  app = fastapi.FastAPI(title="sbd_jax", docs_url=None, redoc_url=None)

  @app.exception_handler(RequestValidationError)
  async def _invalid(request, exc):  # noqa: ARG001
    return _error(400, _validation_message(exc))

  @app.exception_handler(protocol.BadRequest)
  async def _bad(request, exc):  # noqa: ARG001
    return _error(400, str(exc))

  @app.exception_handler(engine_lib.QueueFull)
  async def _full(request, exc):  # noqa: ARG001
    return _error(503, f"queue full: {exc}", "server_busy")

  @app.exception_handler(engine_lib.ShuttingDown)
  async def _down(request, exc):  # noqa: ARG001
    return _error(503, str(exc), "server_unavailable")

  @app.get("/health")
  def health():
    e = served.engine
    status = "ok" if e.error is None else "failed"
    return {
      "status": status,
      "rows_busy": e.busy_rows(),
      "waiting": e.waiting(),
      "compilations": e.compilations(),
      "finished": dict(e.finished),
    }

  @app.get("/v1/models")
  def models():
    card = {"id": served.model_name, "object": "model", "created": 0, "owned_by": "sbd_jax"}
    return {"object": "list", "data": [card]}

  @app.post("/v1/completions")
  async def completions(body: protocol.CompletionRequest, http: fastapi.Request):
    d = protocol.decoding(body, served.run_settings, served.default_mode, served.limits)
    prompts = protocol.prompt_token_lists(body.prompt, served.tokenizer, served.limits)
    return await _respond(served, http, body, d, prompts, chat=False)

  @app.post("/v1/chat/completions")
  async def chat(body: protocol.ChatRequest, http: fastapi.Request):
    if served.template is None:
      raise protocol.BadRequest("this model's tokenizer has no chat template: use /v1/completions")
    d = protocol.decoding(body, served.run_settings, served.default_mode, served.limits)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    text = served.template.render(messages, add_generation_prompt=True)
    ids = list(served.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)
    protocol.check_prompt(ids, served.limits)
    return await _respond(served, http, body, d, [ids], chat=True)

  return app


async def _respond(served: Served, http, body, d: protocol.Decoding, prompts, chat: bool):
  """Submit one engine request per prompt and answer with all of them (streamed or whole)."""
  loop = asyncio.get_running_loop()
  events: asyncio.Queue = asyncio.Queue()
  requests = []
  for index, ids in enumerate(prompts):

    def emit(event, index=index):
      loop.call_soon_threadsafe(events.put_nowait, (index, event))

    requests.append(
      engine_lib.Request(ids, d.settings, d.gamma, d.max_tokens, d.seed, emit, index=index)
    )
  try:
    for request in requests:
      served.engine.submit(request)
  except (engine_lib.QueueFull, engine_lib.ShuttingDown):  # answered 503 by the handlers
    for request in requests:
      request.cancel()
    raise
  texts = [TextStream(served.tokenizer, body.stops()) for _ in prompts]
  meta = {
    "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
    "created": int(time.time()),
    "model": served.model_name,
  }
  usage = _Usage(prompt_tokens=sum(len(p) for p in prompts))

  async def next_event():
    while True:
      try:
        return await asyncio.wait_for(events.get(), timeout=0.5)
      except asyncio.TimeoutError:
        if await http.is_disconnected():
          raise asyncio.CancelledError from None

  async def updates():
    """(choice index, text delta, finish reason or None) until every choice has finished."""
    open_choices = set(range(len(prompts)))
    while open_choices:
      index, event = await next_event()
      if isinstance(event, engine_lib.Finished):
        delta = texts[index].finish()
        reason = "stop" if texts[index].stopped else event.reason
        usage.add(event)
        open_choices.discard(index)
        yield index, delta, reason
      else:
        delta = texts[index].add(event)
        if texts[index].stopped:
          requests[index].cancel()
        if delta:
          yield index, delta, None

  def cancel_all():
    for request in requests:
      request.cancel()

  if body.stream:

    async def sse():
      try:
        if chat:
          yield _sse(_chunk(meta, chat, 0, None, None, role=True))
        async for index, delta, reason in updates():
          yield _sse(_chunk(meta, chat, index, delta, reason))
        if body.include_usage():
          yield _sse({**_chunk(meta, chat, 0, None, None), "choices": [], "usage": usage.dict()})
        yield "data: [DONE]\n\n"
      finally:
        cancel_all()  # a no-op for finished requests; frees the rows of a client that left

    return responses.StreamingResponse(sse(), media_type="text/event-stream")

  try:
    pieces = [[] for _ in prompts]
    reasons = [None] * len(prompts)
    async for index, delta, reason in updates():
      pieces[index].append(delta)
      reasons[index] = reason or reasons[index]
  finally:
    cancel_all()
  if "error" in reasons:
    return _error(500, "the decode failed: see the server's log", "server_error")
  choices = []
  for i, (piece, reason) in enumerate(zip(pieces, reasons)):
    text = "".join(piece)
    if chat:
      choices.append(
        {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
      )
    else:
      choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason})
  kind = "chat.completion" if chat else "text_completion"
  return {**meta, "object": kind, "choices": choices, "usage": usage.dict()}


@dataclasses.dataclass
class _Usage:
  prompt_tokens: int
  completion_tokens: int = 0
  forwards: int = 0

  def add(self, finished: engine_lib.Finished) -> None:
    self.completion_tokens += finished.tokens
    self.forwards += finished.forwards

  def dict(self) -> dict[str, int]:
    return {
      "prompt_tokens": self.prompt_tokens,
      "completion_tokens": self.completion_tokens,
      "total_tokens": self.prompt_tokens + self.completion_tokens,
      "forwards": self.forwards,
    }


def _chunk(meta, chat: bool, index: int, delta, reason, role: bool = False) -> dict:
  if chat:
    content = {"role": "assistant", "content": ""} if role else {"content": delta or ""}
    choice = {"index": index, "delta": content if role or delta else {}, "finish_reason": reason}
    return {**meta, "object": "chat.completion.chunk", "choices": [choice]}
  choice = {"index": index, "text": delta or "", "logprobs": None, "finish_reason": reason}
  return {**meta, "object": "text_completion", "choices": [choice]}


def _sse(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"
