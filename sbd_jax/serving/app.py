"""The HTTP face of the engine: an OpenAI-compatible FastAPI application.

    POST /v1/completions        prompt(s) -> text; "stream": true sends server-sent events, one
                                chunk per settled block (SBD) or token (NTP)
    POST /v1/chat/completions   messages, rendered by the tokenizer's chat template
    GET  /v1/models, /v1/models/{id}
    GET  /health                200 while the engine steps and admits; 503 draining or failed
    GET  /metrics               Prometheus text format (`serving.metrics`)

Errors are OpenAI's shape, {"error": {"message": ..., "type": ...}}, for every status: 400 for a
request that cannot run (one line naming the field), 401 without the API key (when one is set),
404 / 405 for an unknown path or method, 404 `model_not_found` for a `model` other than the one
served (/v1/models; none at all is fine), 413 for a body over the server's limit, 431 for
headers over 16 KiB, 500 for a decode that failed, 503 (with Retry-After) when the queue is
full, the server is draining or its engine failed, 504 for a request not finished within the
server's request timeout (its rows freed at the next step); 500 and 504 carry `x-should-retry:
false`. A body is parsed and validated by `serving.intake`, bounded first. A request not
finished by the drain deadline gets 503 (streamed: an error event), never a partial answer as a
success. `usage` adds `forwards`: the forwards spent on the request (its NFE, the prefill
included; a choice ended by a stop string or stop token id counts those its row had run when
the token that ended it settled), and `rollbacks`: its drafts that verification rejected
(verified SBD); a sampled response reports its `seed`. A client that disconnects
cancels its request, which frees its rows. `serving.guard` gives every response its
`X-Request-Id` and every request one line in the access log; `serving.respond` decodes a
request's choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import fastapi
from fastapi import responses
from starlette.exceptions import HTTPException

from sbd_jax.decode import automata
from sbd_jax.serving import engine as engine_lib
from sbd_jax.serving import guard, intake, protocol, respond, shapes
from sbd_jax.serving import metrics as metrics_lib
from sbd_jax.serving import prompts as prompts_lib
from sbd_jax.serving import requests as requests_lib
from sbd_jax.serving import structured as structured_lib


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
  max_body_bytes: int = guard.MAX_BODY_BYTES  # a larger request body gets 413
  # What constraints compile with, where `limits.structured_output` (unset: the process's
  # compiler, `decode.automata.compiler`)
  structured: structured_lib.StructuredOutput | None = None


async def _parsed(served: Served, http: fastapi.Request, model):
  """The request's body as `model`, bounded before it is parsed and validated (`intake`)."""
  raw = await http.body()
  content_type = http.headers.get("content-type")
  return intake.parse(raw, content_type, model, served.limits, served.engine.max_queue)


def shown_name(name: str, most: int = 64) -> str:
  """A model name a request gave, quoted for an error message: at most `most` characters of
  it (a client's name may be megabytes long)."""
  if len(name) <= most:
    return repr(name)
  return f"{name[:most]!r}... ({len(name)} characters)"


def _derived(served: Served) -> Served:
  """`served` with `limits.max_prompt_chars` derived from the tokenizer where unset, and
  `structured` where the server serves structured output (the process's compiler, unset)."""
  if served.limits.max_prompt_chars is None:
    chars = prompts_lib.char_limit(served.tokenizer, served.limits.max_prompt_tokens)
    served = dataclasses.replace(
      served, limits=dataclasses.replace(served.limits, max_prompt_chars=chars)
    )
  if not served.limits.structured_output:
    return dataclasses.replace(served, structured=None)
  if served.structured is None:
    made = structured_lib.StructuredOutput.of(
      automata.compiler(), served.tokenizer, served.run_settings, served.limits.vocab_size
    )
    served = dataclasses.replace(served, structured=made)
  return served


def create_app(served: Served) -> fastapi.FastAPI:
  """The application (`served` completed by `_derived`)."""
  served = _derived(served)
  app = fastapi.FastAPI(title="sbd_jax", docs_url=None, redoc_url=None)
  metrics = metrics_lib.Metrics(served.engine)
  app.state.metrics = metrics

  app.add_middleware(guard.Guard, api_key=served.api_key, max_body_bytes=served.max_body_bytes)

  @app.exception_handler(HTTPException)
  async def _http(request, exc):  # noqa: ARG001
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return shapes.error(exc.status_code, str(exc.detail), kind)

  @app.exception_handler(protocol.BadRequest)
  async def _bad(request, exc):  # noqa: ARG001
    return shapes.error(400, str(exc), param=exc.param)

  @app.exception_handler(protocol.ModelNotFound)
  async def _no_model(request, exc):  # noqa: ARG001
    message = f"model {shown_name(str(exc))} is not served (this server: {served.model_name!r})"
    return shapes.error(404, message, param="model", code="model_not_found")

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
    check_model(model_id)
    return card

  def check_model(name: str | None) -> None:
    """A request may leave `model` out (vLLM's default); naming another is a 404."""
    if name is not None and name != served.model_name:
      raise protocol.ModelNotFound(name)

  @app.post("/v1/completions")
  async def completions(http: fastapi.Request):
    body = await _parsed(served, http, protocol.CompletionRequest)
    check_model(body.model)
    d = protocol.decoding(body, served.run_settings, served.default_mode, served.limits)
    constraint, field = structured_lib.constraint_of(body, served.structured)
    # Tokenizing a long prompt takes milliseconds: off the event loop, which serves every client.
    prompts = await asyncio.to_thread(
      prompts_lib.token_lists, body.prompt, served.tokenizer, served.limits
    )
    d = await _constrained(served, d, constraint, field)
    return await respond.respond(served, http, body, d, prompts, chat=False)

  @app.post("/v1/chat/completions")
  async def chat(http: fastapi.Request):
    body = await _parsed(served, http, protocol.ChatRequest)
    check_model(body.model)
    if served.template is None:
      raise protocol.BadRequest("this model's tokenizer has no chat template: use /v1/completions")
    d = protocol.decoding(body, served.run_settings, served.default_mode, served.limits)
    constraint, field = structured_lib.constraint_of(body, served.structured)
    messages = [m.rendered() for m in body.messages]
    ids = await asyncio.to_thread(
      prompts_lib.chat_ids, served.template, served.tokenizer, messages, served.limits
    )
    d = await _constrained(served, d, constraint, field)
    return await respond.respond(served, http, body, d, [ids], chat=True)

  return app


async def _constrained(served: Served, d: protocol.Decoding, constraint, field: str):
  """`d` with the constraint and its automaton, compiled off the event loop (`structured`)."""
  if constraint is None:
    return d
  automaton = await served.structured.automaton(constraint, field, served.engine.capacity)
  return dataclasses.replace(d, constraint=constraint, automaton=automaton)
