"""Shared by the server's in-process tests (test_server_app, test_hostile_clients): decode
settings and limits over the peaky model's byte vocabulary, an engine of its shapes, a test
client of its application, and a request passed to the application as a server passes it on."""

import asyncio
import json
import time

from decode_helpers import EOS, MASK, PAD  # tests/ is on sys.path
from fastapi.testclient import TestClient

from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.serving import app as app_lib
from sbd_jax.serving import engine as engine_lib
from sbd_jax.serving import protocol

MAX_NEW = 12
# Forwards at one cost (`wide_cost=1`): each verified row's forwards are then its own, as when
# decoded alone; with measured costs (the default) they are its pool's choice (`decode.policy`).
RUN = SamplerSettings(
  eos_id=EOS, mask_id=MASK, pad_id=PAD, block_size=4, gamma=0.35, max_new_tokens=MAX_NEW,
  wide_cost=1.0,
)  # fmt: skip
LIMITS = protocol.Limits(
  max_prompt_tokens=32, max_new_tokens=MAX_NEW, largest_block=4, vocab_size=260
)


def make_engine(model, **kw):
  kw.setdefault("rows", 2)
  kw.setdefault("forwards_per_call", 2)
  return engine_lib.Engine(model, max_prompt_tokens=LIMITS.max_prompt_tokens, **kw).start()


def make_client(engine, **served):
  served = {"tokenizer": ByteTokenizer(), "template": None, "run_settings": RUN, **served}
  app = app_lib.create_app(
    app_lib.Served(engine=engine, default_mode="sbd", limits=LIMITS, model_name="m", **served)
  )
  return TestClient(app, raise_server_exceptions=False)


def complete(client, prompt="hi", **body):
  return client.post("/v1/completions", json={"prompt": prompt, **body})


def idle(engine, timeout_s: float = 30) -> None:
  """Wait until every request the engine took has finished (bounded). (Not busy rows and
  waiting requests: both read 0 while the engine thread moves requests into a pool.)"""
  deadline = time.monotonic() + timeout_s
  while engine.unfinished() and time.monotonic() < deadline:
    time.sleep(0.01)


async def asgi_request(
  app, raw: bytes, left: asyncio.Event | None = None, *, method="POST",
  path="/v1/completions", headers=((b"content-type", b"application/json"),),
) -> dict:  # fmt: skip
  """Send `raw` to the ASGI `app` as a server passes a request on: the body, then, once `left`
  is set (never, without one), the client's disconnection. Returns the status and body sent
  (after a disconnection a server drops them)."""
  messages = [{"type": "http.request", "body": raw, "more_body": False}]
  sent = {}

  async def receive():
    if messages:
      return messages.pop()
    await (left or asyncio.Event()).wait()
    return {"type": "http.disconnect"}

  async def send(message):
    if message["type"] == "http.response.start":
      sent["status"], sent["headers"] = message["status"], dict(message["headers"])
    elif message["type"] == "http.response.body":
      sent["body"] = sent.get("body", b"") + message.get("body", b"")

  scope = {
    "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
    "method": method, "scheme": "http", "path": path, "query_string": b"",
    "raw_path": path.encode(), "root_path": "", "client": ("127.0.0.1", 9),
    "server": ("127.0.0.1", 80), "headers": list(headers),
  }  # fmt: skip
  await app(scope, receive, send)
  return sent


async def asgi_post(app, body: dict, left: asyncio.Event, headers=()) -> dict:
  """POST the JSON `body` (`asgi_request`)."""
  headers = [(b"content-type", b"application/json"), *headers]
  return await asgi_request(app, json.dumps(body).encode(), left, headers=headers)
