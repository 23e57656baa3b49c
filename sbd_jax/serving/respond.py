"""One HTTP request's decode: its choices (`n` per prompt) submitted to the engine together,
their events merged into a stream or a whole response, and the request accounted once when it
ends: its usage, its metrics and its access-log record (`guard.Record`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from starlette import responses

from sbd_jax.serving import metrics as metrics_lib
from sbd_jax.serving import protocol, shapes, text_stream
from sbd_jax.serving import requests as requests_lib
from sbd_jax.serving.stops import StopStrings


async def respond(served, http, body, d: protocol.Decoding, prompts, chat: bool):
  """The answer to a decode request (`served`: `app.Served`), streamed or whole."""
  decode = Decode(served, http, body, d, prompts, chat)
  if body.stream:
    return _Stream(decode)
  return await decode.whole()


class _Stream(responses.StreamingResponse):
  """A decode's events, streamed; the decode is closed however the stream ends (a client that
  leaves before the first byte stops it before its generator has begun, whose `finally` would
  never run)."""

  def __init__(self, decode: Decode):
    super().__init__(decode.stream(), media_type="text/event-stream")
    self.decode = decode

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.decode.close()


class Decode:
  """The engine requests of one HTTP request, and what has come back of them."""

  def __init__(self, served, http, body, d: protocol.Decoding, prompts, chat: bool):
    self.body, self.chat = body, chat
    self.record = http.state.access
    self.metrics: metrics_lib.Metrics = http.app.state.metrics
    self.prompts = [ids for ids in prompts for _ in range(body.n)]
    self.usage = shapes.Usage(prompt_tokens=sum(len(p) for p in prompts))  # each prompt once
    self.timer = metrics_lib.RequestTimer(self.record.arrival)
    stop_ids = (*served.stop_token_ids, *(body.stop_token_ids or ()))
    stops = StopStrings(body.stops())  # built once, read by every choice
    self.texts = [text_stream.TextStream(served.tokenizer, stops, stop_ids) for _ in self.prompts]
    self.reasons: list[str | None] = [None] * len(self.prompts)
    # A constrained request's choices: {"complete": whether the text returned is one its
    # constraint accepts} (a text cut by a stop string or stop token id is not taken as one)
    self.notes: list[dict | None] = [None] * len(self.prompts)
    self.usage.constrained = d.constraint is not None
    self.meta = {
      "id": ("chatcmpl-" if chat else "cmpl-") + self.record.id,
      "created": int(time.time()),
      "model": served.model_name,
    }
    if d.temperature > 0:
      self.meta["seed"] = d.seed  # replays the sample: prompt i draws with (seed, i)
    self.events: asyncio.Queue = asyncio.Queue()
    self.requests = submit(served, d, self.prompts, self.events, asyncio.get_running_loop())
    # Bounds that hold however fast tokens arrive: the request's deadline (queueing included)
    # cancels its choices, and so does its client leaving (a disconnection is the next
    # message a server passes on once the body has been read).
    loop = asyncio.get_running_loop()
    self.deadline = None
    if served.request_timeout_s:
      left_s = self.record.arrival + served.request_timeout_s - time.monotonic()
      self.deadline = loop.call_later(max(0.0, left_s), self.cancel, "timeout")
    self.watch = asyncio.ensure_future(self._watch_client(http.receive))
    self.answered = self.closed = False

  def cancel(self, reason: str = "cancelled") -> None:
    """Stop every choice still decoding; its rows are freed at the engine's next step."""
    for request in self.requests:
      request.cancel(reason)

  async def _watch_client(self, receive) -> None:
    while (await receive())["type"] != "http.disconnect":
      pass
    self.cancel()

  def _sent_entries(self, index: int) -> list:
    """The log-probability entries of the tokens sent, when asked for: otherwise no per-token
    decoding of the text is done."""
    return self.texts[index].take_sent() if self.body.wants_logprobs() else []

  async def updates(self):
    """(choice index, text delta, finish reason or None, log-probability entries) until every
    choice has finished."""
    open_choices = set(range(len(self.prompts)))
    while open_choices:
      index, event = await self.events.get()
      text = self.texts[index]
      if isinstance(event, requests_lib.Finished):
        delta = text.finish()
        self.reasons[index] = "stop" if text.stopped else event.reason
        if event.complete is not None:
          self.notes[index] = {"complete": event.complete and not text.stopped}
        if text.kept_tokens is not None:  # not the tokens, nor the forwards, past the stop
          forwards = event.forwards if text.kept_forwards is None else text.kept_forwards
          event = dataclasses.replace(event, tokens=text.kept_tokens, forwards=forwards)
        self.usage.add(event)
        open_choices.discard(index)
        yield index, delta, self.reasons[index], self._sent_entries(index)
      else:
        delta = text.add(event)
        if text.stopped:
          self.requests[index].cancel()
        if delta:
          self.timer.chunk(self.metrics)
          yield index, delta, None, self._sent_entries(index)

  def close(self) -> None:
    """Cancel what still decodes (a no-op for finished choices; frees the rows of a client that
    left) and account for the request once: usage, metrics, the access log's record."""
    if self.closed:
      return
    self.closed = True
    self.watch.cancel()
    if self.deadline is not None:
      self.deadline.cancel()
    self.cancel()
    for index, reason in enumerate(self.reasons):
      if reason is None:  # cut short: what it had generated so far
        self.reasons[index] = "cancelled"
        self.usage.completion_tokens += len(self.texts[index].ids)
    answered = self.answered and all(r in ("stop", "length") for r in self.reasons)
    self.metrics.request_done(self.timer, self.usage, self.reasons, answered)
    self.record.decoded(self.reasons, self.usage.dict(), self.timer.ttft())

  async def stream(self):
    """Server-sent events: each choice's chunks, then (asked for) the usage, then [DONE]; a
    choice that fails ends the stream with an error event."""
    body, chat, meta = self.body, self.chat, self.meta
    if chat:
      for index in range(len(self.prompts)):
        yield shapes.sse(shapes.chunk(meta, chat, index, None, None, role=True))
    async for index, delta, reason, entries in self.updates():
      if reason in shapes.FAILED:  # no finish reason that reads as an answer
        yield shapes.sse(shapes.error_event(*shapes.FAILED[reason]))
        return
      scores = shapes.logprobs(chat, entries) if body.wants_logprobs() else None
      note = self.notes[index] if reason is not None else None
      yield shapes.sse(shapes.chunk(meta, chat, index, delta, reason, scores, note))
    if body.include_usage():
      last = shapes.chunk(meta, chat, 0, None, None)
      yield shapes.sse({**last, "choices": [], "usage": self.usage.dict()})
    yield "data: [DONE]\n\n"
    self.answered = True

  async def whole(self):
    """Every choice's text at once (or the error of a choice that failed)."""
    pieces, entries = [[] for _ in self.prompts], [[] for _ in self.prompts]
    try:
      async for index, delta, _, sent in self.updates():
        pieces[index].append(delta)
        entries[index] += sent
      self.answered = True
    finally:
      self.close()
    wanted = self.body.wants_logprobs()
    scores = [shapes.logprobs(self.chat, e) for e in entries] if wanted else None
    texts = ["".join(p) for p in pieces]
    return shapes.whole(
      self.meta, self.chat, texts, self.reasons, self.usage, scores, notes=self.notes
    )


def submit(served, d: protocol.Decoding, prompts, events, loop) -> list:
  """One engine request per prompt, submitted together; their events go to `events` on
  `loop`. BadRequest for settings the server does not serve and for more prompts than its
  queue holds (a request that could never fit); QueueFull / ShuttingDown as the engine raises
  them (nothing queued)."""
  engine = served.engine
  if not engine.serves(d.settings):
    shown = "; ".join(protocol.describe(s) for s in engine.serve_only)
    raise protocol.BadRequest(
      f"this server decodes only what it compiled: {shown} (--block_sizes / --rules add more)"
    )
  protocol.check_choices(len(prompts), engine.max_queue)
  requests = []
  for index, ids in enumerate(prompts):

    def emit(event, index=index):
      try:
        loop.call_soon_threadsafe(events.put_nowait, (index, event))
      except RuntimeError:  # the event loop has closed: the server stopped, nobody listens
        pass

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
        constraint=d.constraint,
        automaton=d.automaton,
      )
    )
  engine.submit(*requests)  # QueueFull / ShuttingDown: answered 503 by the handlers
  return requests
