"""The HTTP face of the engine: an OpenAI-compatible FastAPI application.

    POST /v1/completions        prompt(s) -> text; "stream": true sends server-sent events, one
                                chunk per settled block (SBD) or token (NTP)
    POST /v1/chat/completions   messages, rendered by the tokenizer's chat template
    GET  /v1/models, /v1/models/{id}
    GET  /health                200 while the engine steps and admits; 503 draining or failed
    GET  /metrics               Prometheus text format (`serving.metrics`)

Errors are OpenAI's shape, {"error": {"message": ..., "type": ...}}, for every status: 400 for a
request that cannot run (one line naming the field), 401 without the API key (when one is set),
404 / 405 for an unknown path or method, 500 for a decode that failed, 503 (with Retry-After)
when the queue is full, the server is draining or its engine failed, 504 for a request not
finished within the server's request timeout (its rows freed at the next step). A request not finished by
the drain deadline gets 503 (streamed: an error event), never a partial answer as a success.
`usage` adds `forwards`: the forwards spent on the request (its NFE, the prefill included), and
`rollbacks`: its drafts that verification rejected (verified SBD); a sampled response reports
its `seed`. A client that disconnects cancels its request, which frees
its row. Every response carries `X-Request-Id` (the client's, or a new one), and each request
leaves one line in the access log (logger `sbd_jax.serve.access`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
from typing import Any

import fastapi
from fastapi import responses
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from sbd_jax.serving import engine as engine_lib
from sbd_jax.serving import metrics as metrics_lib
from sbd_jax.serving import protocol, shapes, text_stream
from sbd_jax.serving import requests as requests_lib


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
  api_key: str | None = None  # required as "Authorization: Bearer <key>" on /v1 when set
  # Token ids that end every choice as EOS does (--stop_token_ids: a model's other EOS ids),
  # besides each request's own `stop_token_ids`.
  stop_token_ids: tuple[int, ...] = ()
  request_timeout_s: float = 0.0  # a request unfinished after this long gets 504; 0 = none


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
  metrics = metrics_lib.Metrics(served.engine)
  app.state.metrics = metrics

  @app.middleware("http")
  async def _request_id_and_key(request: fastapi.Request, call_next):
    request.state.id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if served.api_key and request.url.path.startswith("/v1"):
      given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
      if not hmac.compare_digest(given.encode(), served.api_key.encode()):
        reply = shapes.error(
          401, "missing or wrong API key (Authorization: Bearer <key>)", "auth_error"
        )
        reply.headers["X-Request-Id"] = request.state.id
        return reply
    reply = await call_next(request)
    reply.headers["X-Request-Id"] = request.state.id
    return reply

  @app.exception_handler(HTTPException)
  async def _http(request, exc):  # noqa: ARG001
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return shapes.error(exc.status_code, str(exc.detail), kind)

  @app.exception_handler(RequestValidationError)
  async def _invalid(request, exc):  # noqa: ARG001
    return shapes.error(400, _validation_message(exc))

  @app.exception_handler(protocol.BadRequest)
  async def _bad(request, exc):  # noqa: ARG001
    return shapes.error(400, str(exc))

  @app.exception_handler(requests_lib.QueueFull)
  async def _full(request, exc):  # noqa: ARG001
    return shapes.error(503, f"queue full: {exc}", "server_busy")

  @app.exception_handler(requests_lib.ShuttingDown)
  async def _down(request, exc):  # noqa: ARG001
    return shapes.error(503, str(exc), "server_unavailable")

  @app.get("/health")
  def health():
    e = served.engine
    status = "ok" if e.alive() else ("failed" if e.error is not None else "draining")
    body = {
      "status": status,
      "rows_busy": e.busy_rows(),
      "waiting": e.waiting(),
      "compilations": e.compilations(),
      "finished": dict(e.finished),
    }
    if status == "ok":
      return body
    headers = {"Retry-After": str(shapes.RETRY_AFTER_S)}
    return responses.JSONResponse(body, status_code=503, headers=headers)

  @app.get("/metrics")
  def prometheus():
    payload, content_type = metrics.exposition()
    return responses.Response(payload, media_type=content_type)

  card = {"id": served.model_name, "object": "model", "created": 0, "owned_by": "sbd_jax"}

  @app.get("/v1/models")
  def models():
    return {"object": "list", "data": [card]}

  @app.get("/v1/models/{model_id:path}")
  def model(model_id: str):
    if model_id != served.model_name:
      served_name = served.model_name
      message = f"model {model_id!r} is not served (this server: {served_name!r})"
      return shapes.error(404, message, "not_found")
    return card

  @app.post("/v1/completions")
  async def completions(body: protocol.CompletionRequest, http: fastapi.Request):
    d = protocol.decoding(body, served.run_settings, served.default_mode, served.limits)
    # Tokenizing a long prompt takes milliseconds: off the event loop, which serves every client.
    prompts = await asyncio.to_thread(
      protocol.prompt_token_lists, body.prompt, served.tokenizer, served.limits
    )
    return await _respond(served, http, body, d, prompts, chat=False)

  @app.post("/v1/chat/completions")
  async def chat(body: protocol.ChatRequest, http: fastapi.Request):
    if served.template is None:
      raise protocol.BadRequest("this model's tokenizer has no chat template: use /v1/completions")
    d = protocol.decoding(body, served.run_settings, served.default_mode, served.limits)
    messages = [m.rendered() for m in body.messages]
    ids = await asyncio.to_thread(_chat_prompt, served, messages)
    return await _respond(served, http, body, d, [ids], chat=True)

  return app


def _chat_prompt(served: Served, messages: list[dict]) -> list[int]:
  text = served.template.render(messages, add_generation_prompt=True)
  ids = list(served.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)
  protocol.check_prompt(ids, served.limits)
  return ids


async def _respond(served: Served, http, body, d: protocol.Decoding, prompts, chat: bool):
  """Submit one engine request per choice (`body.n` per prompt) and answer with all of them
  (streamed or whole)."""
  prompt_tokens = sum(len(p) for p in prompts)
  prompts = [ids for ids in prompts for _ in range(body.n)]
  loop = asyncio.get_running_loop()
  events: asyncio.Queue = asyncio.Queue()
  metrics: metrics_lib.Metrics = http.app.state.metrics
  timers = [metrics_lib.RequestTimer() for _ in prompts]
  requests = _submit(served, d, prompts, events, loop)
  stop_ids = (*served.stop_token_ids, *(body.stop_token_ids or ()))
  texts = [text_stream.TextStream(served.tokenizer, body.stops(), stop_ids) for _ in prompts]
  meta = {
    "id": ("chatcmpl-" if chat else "cmpl-") + http.state.id,
    "created": int(time.time()),
    "model": served.model_name,
  }
  if d.temperature > 0:
    meta["seed"] = d.seed  # replays the sample: prompt i draws with (seed, i)
  usage = shapes.Usage(prompt_tokens=prompt_tokens)

  deadline = time.monotonic() + served.request_timeout_s if served.request_timeout_s else None

  async def next_event():
    while True:
      try:
        return await asyncio.wait_for(events.get(), timeout=0.1)
      except asyncio.TimeoutError:
        if await http.is_disconnected():
          raise asyncio.CancelledError from None
        if deadline is not None and time.monotonic() > deadline:
          for request in requests:  # their rows are freed at the next step
            request.cancel("timeout")

  def sent_entries(index: int) -> list:
    """The log-probability entries of the tokens sent, when asked for: otherwise no per-token
    decoding of the text is done."""
    return texts[index].take_sent() if body.wants_logprobs() else []

  async def updates():
    """(choice index, text delta, finish reason or None) until every choice has finished."""
    open_choices = set(range(len(prompts)))
    while open_choices:
      index, event = await next_event()
      if isinstance(event, requests_lib.Finished):
        delta = texts[index].finish()
        reason = "stop" if texts[index].stopped else event.reason
        if texts[index].kept_tokens is not None:  # not the tokens decoded past the stop
          event = dataclasses.replace(event, tokens=texts[index].kept_tokens)
        usage.add(event)
        open_choices.discard(index)
        _log_choice(http, index, reason, len(prompts[index]), event, timers[index], metrics)
        yield index, delta, reason, sent_entries(index)
      else:
        delta = texts[index].add(event)
        if texts[index].stopped:
          requests[index].cancel()
        if delta:
          timers[index].chunk(metrics)
          yield index, delta, None, sent_entries(index)

  def cancel_all():
    for request in requests:
      request.cancel()

  if body.stream:

    async def sse():
      try:
        if chat:
          for index in range(len(prompts)):
            yield shapes.sse(shapes.chunk(meta, chat, index, None, None, role=True))
        async for index, delta, reason, entries in updates():
          if reason in shapes.FAILED:  # no finish reason that reads as an answer
            yield shapes.sse(shapes.error_event(*shapes.FAILED[reason]))
            return
          scores = shapes.logprobs(chat, entries) if body.wants_logprobs() else None
          yield shapes.sse(shapes.chunk(meta, chat, index, delta, reason, logprobs=scores))
        if body.include_usage():
          yield shapes.sse(
            {**shapes.chunk(meta, chat, 0, None, None), "choices": [], "usage": usage.dict()}
          )
        yield "data: [DONE]\n\n"
      finally:
        cancel_all()  # a no-op for finished requests; frees the rows of a client that left

    return responses.StreamingResponse(sse(), media_type="text/event-stream")

  try:
    pieces, entries = [[] for _ in prompts], [[] for _ in prompts]
    reasons = [None] * len(prompts)
    async for index, delta, reason, sent in updates():
      pieces[index].append(delta)
      entries[index] += sent
      reasons[index] = reason or reasons[index]
  finally:
    cancel_all()
  scores = [shapes.logprobs(chat, e) for e in entries] if body.wants_logprobs() else None
  return shapes.whole(meta, chat, ["".join(p) for p in pieces], reasons, usage, scores)


def _submit(served: Served, d: protocol.Decoding, prompts, events, loop) -> list:
  """One engine request per prompt, submitted; their events go to `events` on `loop`.
  BadRequest for settings the server does not serve; QueueFull / ShuttingDown as the engine
  raises them (nothing left queued)."""
  if not served.engine.serves(d.settings):
    shown = "; ".join(protocol.describe(s) for s in served.engine.serve_only)
    raise protocol.BadRequest(f"this server decodes only: {shown} (its --block_sizes, --rules)")
  requests = []
  for index, ids in enumerate(prompts):

    def emit(event, index=index):
      loop.call_soon_threadsafe(events.put_nowait, (index, event))

    requests.append(
      requests_lib.Request(
        ids,
        d.settings,
        d.gamma,
        d.max_tokens,
        protocol.key_seed(d.seed),
        emit,
        index=index,
        temperature=d.temperature,
        verify=d.verify,
      )
    )
  try:
    for request in requests:
      served.engine.submit(request)
  except (requests_lib.QueueFull, requests_lib.ShuttingDown):  # answered 503 by the handlers
    for request in requests:
      request.cancel()
    raise
  return requests


def _log_choice(http, index: int, reason: str, prompt_tokens: int, event, timer, metrics) -> None:
  """A finished choice: into the metrics, and one line of the access log."""
  metrics.finished.labels(reason).inc()
  times = timer.done(metrics, prompt_tokens, event.tokens, event.forwards, event.rollbacks)
  metrics_lib.access_log.info(
    "request=%s choice=%d finish=%s prompt_tokens=%d completion_tokens=%d forwards=%d "
    "rollbacks=%d ttft_s=%.4f latency_s=%.4f",
    http.state.id, index, reason, prompt_tokens, event.tokens, event.forwards, event.rollbacks,
    times["ttft_s"], times["latency_s"],
  )  # fmt: skip
