"""Clients that misbehave, on purpose or not, against the server: every answer is below 500, in
OpenAI's shape with its request id; /health stays truthful throughout; a client that leaves
frees its rows; the server's memory stays bounded.

In-process (FastAPI's application over the peaky model, the default tier): malformed, deeply
nested, mis-encoded and mistyped bodies, text the tokenizer cannot take, values past their
bounds, `n` at its bound, and clients that leave before the first byte. Live (integration tier:
`python -m sbd_jax.serve` on an untrained byte-vocabulary model, real sockets): slowloris
sockets, disconnects mid-stream and before the first byte, bodies over the limit by
Content-Length and chunked, a prompt too long to tokenize, RSS, settings the server did not
compile, the access log's one line per request, and SIGTERM with /health answering while the
server drains.
"""

import asyncio
import http.client
import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from decode_helpers import peaky_model  # tests/ is on sys.path
from server_helpers import (
  MAX_NEW,
  asgi_post,
  asgi_request,
  complete,
  idle,
  make_client,
  make_engine,
)

from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode import sampler
from sbd_jax.serving import slots as slots_lib
from sbd_jax.serving import text_stream

# (what, raw body, content type, status): bodies no server should answer with a 5xx.
HOSTILE = [
  ("nested JSON", b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
  ("a nested prompt", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, 400),
  ("invalid UTF-8", b'{"prompt": "\xff\xfe\xfd"}', None, 400),
  ("a truncated body", b'{"prompt": "hi", ', None, 400),
  ("not an object", b"[]", None, 400),
  ("null", b"null", None, 400),
  ("text/plain", b'{"prompt": "hi"}', "text/plain", 400),
  ("a form", b"prompt=hi", "application/x-www-form-urlencoded", 400),
  ("multipart", b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--x--',
   "multipart/form-data; boundary=x", 400),
  ("no content type", b'{"prompt": "hi"}', "", 400),
  ("a lone surrogate", b'{"prompt": "\\ud800"}', None, 400),
  ("a surrogate as a field name", b'{"prompt": "hi", "\\udfff": 1}', None, 400),
  ("a surrogate as the model", b'{"prompt": "hi", "model": "\\ud800"}', None, 404),
  ("an integer of 5000 digits", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", None, 400),
  ("an infinite max_tokens", b'{"prompt": "hi", "max_tokens": 1e400}', None, 400),
  ("a seed past int64", b'{"prompt": "hi", "seed": 9223372036854775808}', None, 400),
  ("n past its bound", b'{"prompt": "hi", "n": 17}', None, 400),
  ("more choices than the queue", json.dumps({"prompt": ["a"] * 17, "n": 16}).encode(), None,
   400),
  ("token ids outside the vocabulary", b'{"prompt": [[5, 999999]]}', None, 400),
  ("another model", b'{"prompt": "hi", "model": "gpt-4o"}', None, 404),
  ("a suffix", b'{"prompt": "hi", "suffix": "x"}', None, 400),
  ("best_of 2", b'{"prompt": "hi", "best_of": 2}', None, 400),
]  # fmt: skip
IDS = [case[0] for case in HOSTILE]


def _headers(content_type: str | None) -> dict:
  """None: JSON's content type; "": no content type."""
  if content_type is None:
    return {"Content-Type": "application/json"}
  return {"Content-Type": content_type} if content_type else {}


def _check_refusal(status: int, headers, text: str, want: int, what: str) -> None:
  error = json.loads(text)["error"]
  assert status == want, (what, status, text[:300])
  assert error["message"] and "\n" not in error["message"] and headers["x-request-id"], what


# -- in-process ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
  e = make_engine(sampler.SamplingModel.of(peaky_model()))
  yield e
  e.drain(0)


@pytest.fixture(scope="module")
def client(engine):
  with make_client(engine) as c:
    yield c


@pytest.mark.parametrize("what, raw, content_type, status", HOSTILE, ids=IDS)
def test_a_hostile_body_gets_a_4xx_in_openais_shape(client, engine, what, raw, content_type,
                                                    status):  # fmt: skip
  headers = {"X-Request-Id": "hostile", **_headers(content_type)}
  r = client.post("/v1/completions", content=raw, headers=headers)
  _check_refusal(r.status_code, r.headers, r.text, status, what)
  assert client.get("/health").json()["status"] == "ok" and engine.alive()


def test_n_at_its_bound_is_served(client):
  """n = 16, and 16 prompts x 16 choices: as many as the queue (--max_queue=256) holds."""
  r = complete(client, n=16, max_tokens=2, decoding="ntp")
  assert r.status_code == 200 and len(r.json()["choices"]) == 16
  r = complete(client, prompt=["a"] * 16, n=16, max_tokens=1, decoding="ntp")
  assert r.status_code == 200 and len(r.json()["choices"]) == 256


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_first_byte_cancels_every_choice(client, engine, stream,
                                                                        monkeypatch):  # fmt: skip
  """Gone before a byte of the response (even before a streamed response's generator starts):
  every choice is cancelled, no row stays busy and the server stays healthy. (Each device call
  is slowed by 50 ms: a choice takes 6 calls, so none can end before the cancellation.)"""
  real_advance = slots_lib.advance
  monkeypatch.setattr(
    slots_lib, "advance", lambda *a, **k: time.sleep(0.05) or real_advance(*a, **k)
  )
  app = client.app
  before = engine.finished["cancelled"]

  async def leave_at_once():
    left = asyncio.Event()
    left.set()
    body = {"prompt": "hi", "n": 8, "max_tokens": 12, "decoding": "ntp", "stream": stream}
    return await asgi_post(app, body, left)

  asyncio.run(leave_at_once())
  idle(engine)
  assert engine.finished["cancelled"] - before == 8
  assert engine.busy_rows() == 0 and engine.waiting() == 0
  assert client.get("/health").json()["status"] == "ok"


def _template():
  """A chat template that adds a tag per message (6 characters for a user's)."""
  from sbd_jax.data.chat import ChatTemplate

  return ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", {})


class CountingTokenizer(ByteTokenizer):
  """Counts the texts it encodes (their lengths)."""

  def __init__(self):
    super().__init__()
    self.encoded = []

  def encode(self, text):
    self.encoded.append(len(text))
    return super().encode(text)


def _refused(reply, status: int, *words: str) -> str:
  message = reply.json()["error"]["message"]
  assert reply.status_code == status and "\n" not in message, (reply.status_code, message[:300])
  assert all(w in message for w in words), message[:300]
  return message


def test_long_lists_are_refused_by_their_length_before_an_item_is_validated(engine, monkeypatch):
  """Lists past what the server takes are refused by their length alone, before pydantic
  validates an item (it is never called) or a prompt is tokenized: a body of more JSON items
  than the largest request holds (before it is parsed), more choices (prompts x n) than the
  queue holds, more token ids or messages or content parts than --max_prompt_tokens, more stop
  strings than 8. At the bounds, requests are served (choices at the queue's bound:
  `test_n_at_its_bound_is_served`)."""
  from sbd_jax.serving import protocol

  validated = []
  for model in (protocol.CompletionRequest, protocol.ChatRequest):
    real = model.model_validate
    monkeypatch.setattr(
      model, "model_validate", lambda d, real=real: validated.append(d) or real(d)
    )
  with make_client(engine, template=_template()) as c:
    cases = [
      ({"prompt": [[1]] * 1_000_000, "max_tokens": 1}, "JSON items, more than any request"),
      ({"prompt": ["a"] * 257}, "257 choices (prompts x n): more than the server queues"),
      ({"prompt": [[1]] * 64, "n": 5}, "320 choices (prompts x n)"),
      ({"prompt": [7] * 33}, "prompt has 33 tokens, more than the server's --max_prompt_tokens=32"),
      ({"prompt": "hi", "stop": ["x"] * 9}, "stop: at most 8 strings"),
    ]
    for body, words in cases:
      _refused(complete(c, **body), 400, words)
    chats = [
      ({"messages": [{"role": "user", "content": ""}] * 33}, "33 messages, more than"),
      ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 33}]},
       "33 content parts"),
    ]  # fmt: skip
    for body, words in chats:
      _refused(c.post("/v1/chat/completions", json=body), 400, words)
    assert validated == []
    assert complete(c, prompt=[7] * 32, max_tokens=1, decoding="ntp").status_code == 200
    chat = {"messages": [{"role": "user", "content": ""}] * 4, "max_tokens": 1}
    assert c.post("/v1/chat/completions", json=chat).status_code == 200


def test_the_rendered_chat_is_bounded_in_characters(engine):
  """The chat template adds text per message: empty messages whose contents sum to nothing still
  render to more characters than --max_prompt_tokens tokens spell, and are refused before the
  rendered text is encoded."""
  tokenizer = CountingTokenizer()
  with make_client(engine, tokenizer=tokenizer, template=_template()) as c:
    chat = {"messages": [{"role": "user", "content": ""}] * 20}  # 20 x "<user>" (6 characters)
    _refused(c.post("/v1/chat/completions", json=chat), 400, "the rendered chat has 120 characters")
  assert tokenizer.encoded == []


def test_nulls_where_openais_spec_allows_them_are_the_defaults(engine):
  """null for n, stream, frequency_penalty, presence_penalty, echo and chat's logprobs is the
  field's default, and an assistant message's content may be null (as clients that send every
  field send them); a user message's content may not."""
  nulls = dict.fromkeys(["n", "stream", "frequency_penalty", "presence_penalty"])
  with make_client(engine, template=_template()) as c:
    r = complete(c, max_tokens=2, echo=None, logprobs=None, **nulls)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "ok"}]  # fmt: skip
    chat = {"messages": messages, "max_tokens": 2, "logprobs": None, **nulls}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    chat["messages"] = [{"role": "user", "content": None}]
    _refused(c.post("/v1/chat/completions", json=chat), 400, "content: null only in an assistant")


def test_small_protocol_gaps_are_refused_as_openai_refuses_them(engine):
  """An image part says images are not supported; a megabyte model name is not echoed whole;
  top_logprobs without logprobs and stream_options without stream are refused."""
  image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
  with make_client(engine, template=_template()) as c:
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    _refused(c.post("/v1/chat/completions", json=chat), 400, "content[1]: images are not supported")
    message = _refused(complete(c, model="m" * 2**20), 404, "(1048576 characters)")
    assert len(message) < 300
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _refused(c.post("/v1/chat/completions", json={**chat, "top_logprobs": 0}), 400,
             "top_logprobs is only allowed with logprobs=true")  # fmt: skip
    options = {"stream_options": {"include_usage": True}}
    _refused(complete(c, **options), 400, "stream_options is only allowed with stream=true")
    assert c.post("/v1/chat/completions", json={**chat, "stream_options": None}).status_code == 200


def test_timeouts_and_failed_decodes_are_not_retried_by_openais_client(engine, monkeypatch):
  """A 504 (--request_timeout) and a failed decode's 500 carry `x-should-retry: false`: the
  official client, allowed two retries, sends the timed-out request once; a 503 keeps
  Retry-After and no such header (a full queue is worth retrying)."""
  openai = pytest.importorskip("openai")
  from sbd_jax.serving import shapes

  with make_client(engine) as warm:
    assert complete(warm, max_tokens=MAX_NEW, decoding="ntp").status_code == 200  # compiled
  real_advance = slots_lib.advance
  monkeypatch.setattr(
    slots_lib, "advance", lambda *a, **k: time.sleep(0.05) or real_advance(*a, **k)
  )
  before = engine.finished["timeout"]
  with make_client(engine, request_timeout_s=0.1) as c:
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=c, max_retries=2)
    with pytest.raises(openai.APIStatusError) as refused:
      api.completions.create(
        model="m", prompt="hi", max_tokens=MAX_NEW, extra_body={"decoding": "ntp"}
      )
    assert refused.value.status_code == 504
    assert refused.value.response.headers["x-should-retry"] == "false"
  idle(engine)
  assert engine.finished["timeout"] - before == 1
  failed = shapes.whole({}, False, [""], ["error"], shapes.Usage(0))
  assert failed.status_code == 500 and failed.headers["x-should-retry"] == "false"
  busy = shapes.error(503, "queue full", "server_busy")
  assert busy.headers["retry-after"] and "x-should-retry" not in busy.headers


def test_usage_forwards_after_a_stop_string_do_not_depend_on_timing(client, engine):
  """A choice cut by a stop string reports the forwards its row had run when the token that
  completed the stop string settled: an NTP row's k-th token settles at its k-th forward, so
  the same as a request for exactly those k tokens, alone or beside other requests (a device
  call runs 2 forwards, so a row that ran to the end of its call would report more)."""
  whole = complete(client, max_tokens=MAX_NEW, decoding="ntp").json()["choices"][0]["text"]
  k = next(k for k in range(4, len(whole) + 1, 2) if whole[k - 2 : k] not in whole[: k - 1])
  stop = {"stop": whole[k - 2 : k], "max_tokens": MAX_NEW, "decoding": "ntp"}
  exact = complete(client, max_tokens=k, decoding="ntp").json()["usage"]
  assert exact["forwards"] == k and exact["completion_tokens"] == k
  alone = complete(client, **stop).json()
  assert alone["choices"][0]["text"] == whole[: k - 2] and alone["usage"] == exact
  for prompts, n in ((["hi"], 4), (["hi", "hi"], 3)):  # rows shared, waiting, refilled
    batch = complete(client, prompt=prompts, n=n, **stop).json()
    assert {c["text"] for c in batch["choices"]} == {whole[: k - 2]}
    assert batch["usage"]["forwards"] == len(prompts) * n * k


def test_stop_strings_cost_the_new_text_not_the_text_times_the_stops():
  """Eight stop strings of 256 characters that never match cost little more per token than
  none, however long the text (matching them by slicing and comparing the text's end against
  each of their prefixes costs about 60 times as much), and where the text is cut does not
  depend on the tokens it arrives in."""
  stops = ["".join(chr(0x4E00 + (i * 7 + j) % 50) for j in range(256)) for i in range(8)]
  text = [*("the quick brown fox jumps over the lazy dog. " * 100).encode()]

  def seconds(with_stops: list[str]) -> float:
    stream = text_stream.TextStream(ByteTokenizer(), with_stops)
    began = time.perf_counter()
    for token in text:
      stream.add([token])
    return time.perf_counter() - began

  ratios = [seconds(stops) / seconds([]) for _ in range(3)]
  assert min(ratios) < 5, ratios
  ends = set()
  for chunk in (1, 2, 3, 7):
    stream = text_stream.TextStream(ByteTokenizer(), ["fox jumps", "brown"])
    sent = "".join(
      stream.add([*b"the quick brown fox jumps"[i : i + chunk]]) for i in range(0, 25, chunk)
    )
    ends.add((sent, stream.kept_tokens))
  assert ends == {("the quick ", 15)}


def test_operations_client_address_exact_bearer_and_header_limit(engine, caplog):
  """The access log names the client's address; an API key is only taken as exactly "Bearer
  <key>"; a request line and headers over 16 KiB get 431 in OpenAI's shape."""
  with make_client(engine, api_key="k") as c:
    for given, status in (("k", 401), ("bearer k", 401), ("Bearer k ", 401), ("Bearer k", 200)):
      r = c.get("/v1/models", headers={"Authorization": given})
      assert r.status_code == status, given
    app = c.app

  async def ask():
    headers = [(b"authorization", b"Bearer k"), (b"x-request-id", b"addressed")]
    ok = await asgi_request(app, b"", method="GET", path="/v1/models", headers=headers)
    big = await asgi_request(
      app, b"", method="GET", path="/health", headers=[(b"x-big", b"a" * 17000)]
    )
    return ok, big

  with caplog.at_level(logging.INFO, logger="sbd_jax.serve.access"):
    ok, big = asyncio.run(ask())
  assert ok["status"] == 200 and big["status"] == 431
  assert "16384 bytes" in json.loads(big["body"])["error"]["message"]
  (line,) = [r.getMessage() for r in caplog.records if "request=addressed " in r.getMessage()]
  assert " client=127.0.0.1:9 " in line


def test_a_request_timeout_of_zero_or_less_is_refused_at_start_up():
  """--request_timeout must be positive (unset: no limit), --step_timeout not negative: each
  refused in one line before the workdir is read."""
  from sbd_jax import serve

  for flag, value in (("request_timeout", 0.0), ("request_timeout", -1.0), ("step_timeout", -1.0)):
    with pytest.raises(ValueError, match=f"--{flag}=") as refused:
      serve.build("/nonexistent", **{flag: value})
    assert "\n" not in str(refused.value)


# -- live ------------------------------------------------------------------------------------


class Server:
  """`python -m sbd_jax.serve` on one device, its output collected as it comes (a pipe left
  unread would block the server once full)."""

  def __init__(self, workdir: str, *flags: str):
    from xla_env import xla_flags  # tests/ is on sys.path

    from sbd_jax.serving.process import ServerProcess

    self.process = ServerProcess(workdir, *flags, env={"XLA_FLAGS": xla_flags(1)}, start_s=900)
    self.url, self.port = self.process.url, self.process.port
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.proc.stdout:
      self.lines.append(line)

  def health(self) -> tuple[int, dict]:
    try:
      with urllib.request.urlopen(f"{self.url}/health", timeout=30) as r:
        return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
      return e.code, json.loads(e.read())

  def request(self, body: bytes, headers=None, path="/v1/completions", chunked=False):
    """(status, headers, text) of a raw POST (JSON's content type unless `headers` name one)."""
    connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
    try:
      headers = headers if headers is not None else _headers(None)
      if chunked:
        pieces = (body[i : i + 65536] for i in range(0, len(body), 65536))
        connection.request("POST", path, body=pieces, headers=headers, encode_chunked=True)
      else:
        connection.request("POST", path, body=body, headers=headers)
      r = connection.getresponse()
      return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
      connection.close()

  def rss(self) -> int:
    import psutil

    return psutil.Process(self.process.proc.pid).memory_info().rss

  def stop(self) -> int:
    code = self.process.stop()
    self._reader.join(30)
    return code


class HealthWatch:
  """/health polled from a thread while a case runs: every answer must be 200 "ok"."""

  def __init__(self, server: Server):
    self.server, self.answers, self.stop = server, [], threading.Event()
    self.latencies: list[float] = []  # seconds from asking to the whole answer
    self.thread = threading.Thread(target=self._poll, daemon=True)

  def _poll(self):
    while not self.stop.is_set():
      began = time.monotonic()
      try:
        status, body = self.server.health()
        self.answers.append((status, body["status"]))
      except OSError as e:  # no answer within the urlopen timeout, or none at all
        self.answers.append((None, repr(e)))
      self.latencies.append(time.monotonic() - began)
      self.stop.wait(0.05)

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop.set()
    self.thread.join(60)
    if exc[0] is None:
      assert self.answers and set(self.answers) == {(200, "ok")}, self.answers


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """An untrained run of a tiny model over the byte vocabulary (SBD block 4)."""
  from run_helpers import untrained_workdir  # tests/ is on sys.path

  from sbd_jax import config as config_lib
  from sbd_jax.model.architectures import tiny

  c = config_lib.base_config(
    tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  )
  c.sample.block_size = 4
  return untrained_workdir(str(tmp_path_factory.mktemp("run")), c)


@pytest.fixture(scope="module")
def server(workdir):
  s = Server(workdir, "--rows=2", "--max_prompt_tokens=64", "--max_new_tokens=512")
  yield s
  assert s.stop() == 0


@pytest.mark.integration
def test_hostile_bodies_and_large_ones_get_4xx_while_health_answers(server):
  """Every hostile body, a body over --max_body_bytes (default 4 MiB) by Content-Length and
  chunked, and a prompt under the body limit but longer than --max_prompt_tokens can spell:
  4xx in OpenAI's shape with its id, /health 200 throughout, RSS grown by less than 64 MiB
  (each body refused unread or read once, never tokenized; tokenized whole, the 10 MiB prompt
  alone adds about 110 MiB)."""
  rss = server.rss()
  large = b'{"prompt": "' + b"a" * (10 * 2**20) + b'"}'
  long_prompt = b'{"prompt": "' + b"a" * (4 * 2**20 - 100) + b'"}'
  cases = [(what, raw, content_type, status, False) for what, raw, content_type, status in HOSTILE]
  cases += [("10 MiB", large, None, 413, False), ("10 MiB chunked", large, None, 413, True)]
  cases += [("a 4 MiB prompt", long_prompt, None, 400, False)] * 8
  with HealthWatch(server):
    for what, raw, content_type, want, chunked in cases:
      status, reply_headers, text = server.request(raw, _headers(content_type), chunked=chunked)
      _check_refusal(status, reply_headers, text, want, what)
  assert server.rss() - rss < 64 * 2**20


@pytest.mark.integration
def test_slowloris_sockets_do_not_starve_other_clients(server):
  """64 connections that send a request's headers a byte at a time, never finishing: a
  well-behaved client is served all the while, and /health answers throughout."""
  sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(64)]
  head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-"
  stop = threading.Event()

  def trickle():
    for i in range(len(head) * 4):
      if stop.is_set():
        return
      for s in sockets:
        try:
          s.send(head[i % len(head) : i % len(head) + 1])
        except OSError:
          pass
      stop.wait(0.05)

  sender = threading.Thread(target=trickle, daemon=True)
  with HealthWatch(server):
    sender.start()
    for i in range(3):
      body = json.dumps({"prompt": f"ok {i}", "max_tokens": 8}).encode()
      status, _, text = server.request(body)
      assert status == 200 and json.loads(text)["choices"][0]["finish_reason"], text
    stop.set()
    sender.join(30)
  for s in sockets:
    s.close()


def _raw_post(port: int, body: dict, request_id: str) -> socket.socket:
  raw = json.dumps(body).encode()
  s = socket.create_connection(("127.0.0.1", port))
  s.sendall(
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    + f"X-Request-Id: {request_id}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
    + raw
  )
  return s


def _wait(condition, timeout_s: float = 120) -> bool:
  deadline = time.monotonic() + timeout_s
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)
  return condition()


@pytest.mark.integration
def test_clients_that_leave_mid_stream_or_before_the_first_byte_free_their_rows(server):
  """Real sockets: a streamed request closed after its first chunk, and a whole one closed
  while it decodes (before a byte of its response): the choices of each that had not ended are
  cancelled (8 choices over 2 rows: at least 4), the rows are freed, /health stays 200, and
  each leaves one access-log line (499 before the first byte; the status sent and `cancelled`
  mid-stream)."""
  body = {"prompt": "leave", "n": 8, "max_tokens": 512, "decoding": "ntp"}

  def cancelled():
    return server.health()[1]["finished"].get("cancelled", 0)

  def idle():
    return server.health()[1]["rows_busy"] == 0 == server.health()[1]["waiting"]

  with HealthWatch(server):
    before = cancelled()
    streamed = _raw_post(server.port, {**body, "stream": True}, "left-mid-stream")
    received = b""
    while b"data: " not in received:  # the response has begun
      received += streamed.recv(65536)
    streamed.close()
    assert _wait(idle) and cancelled() - before >= 4
    before = cancelled()
    whole = _raw_post(server.port, body, "left-before-a-byte")
    assert _wait(lambda: server.health()[1]["rows_busy"] > 0)
    whole.close()
    assert _wait(idle) and cancelled() - before >= 4
  assert _wait(lambda: len([x for x in server.lines if "request=left-" in x]) >= 2, 30)
  (mid,) = [x for x in server.lines if "request=left-mid-stream " in x]
  (gone,) = [x for x in server.lines if "request=left-before-a-byte " in x]
  assert " status=200 " in mid and "cancelled" in mid
  assert " status=499 " in gone and "cancelled" in gone


@pytest.mark.integration
def test_the_server_serves_what_it_compiled_and_logs_each_request_once(server, workdir):
  """A default server (no --block_sizes): another block size or rule gets 400 naming what is
  served and compiles nothing. The served name is the workdir's. Each request's access-log
  line is printed once (absl's root handler does not print it again)."""
  compilations = server.health()[1]["compilations"]
  for i, other in enumerate(({"block_size": 2}, {"rule": "threshold"})):
    body = json.dumps({"prompt": "hi", "max_tokens": 4, **other}).encode()
    status, _, text = server.request(body, {**_headers(None), "X-Request-Id": f"other-{i}"})
    assert status == 400 and "decodes only what it compiled: ntp; sbd block_size=4" in text
  ok = {**_headers(None), "X-Request-Id": "ok"}
  status, _, text = server.request(b'{"prompt": "hi", "max_tokens": 4}', ok)
  assert status == 200 and server.health()[1]["compilations"] == compilations
  with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as r:
    assert [m["id"] for m in json.loads(r.read())["data"]] == [os.path.basename(workdir)]
  for request_id in ("other-0", "other-1", "ok"):
    assert _wait(lambda i=request_id: any(f"request={i} " in x for x in server.lines), 30)
    assert len([x for x in server.lines if f"request={request_id} " in x]) == 1, request_id


@pytest.mark.integration
def test_sigterm_drains_with_health_answering_503(workdir):
  """SIGTERM: while in-flight requests finish, the port stays open: /health answers 503
  "draining" (with Retry-After) and a new request gets 503, for as long as the drain lasts
  (here, a streamed request of 16 choices over one row, begun before the signal: asked once a
  choice has ended after the signal, with more still to decode); then that request is answered
  whole and the process exits 0."""
  s = Server(workdir, "--rows=1", "--max_prompt_tokens=16", "--max_new_tokens=128",
             "--shutdown_deadline=300")  # fmt: skip
  try:
    body = {"prompt": "x", "n": 16, "max_tokens": 128, "decoding": "ntp", "stream": True}
    stream = _raw_post(s.port, body, "in-flight").makefile("rb")
    while not stream.readline().startswith(b"data: "):  # it decodes
      pass
    s.process.proc.send_signal(signal.SIGTERM)
    ended = []
    while not ended:  # a choice ends: the server has decoded since the signal
      line = stream.readline()
      assert line, "the stream ended early"
      if line.startswith(b"data: {"):
        ended += [c for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    assert ended[0]["index"] < 15
    status, health = s.health()
    assert status == 503 and health["status"] == "draining"
    status, headers, text = s.request(b'{"prompt": "y", "max_tokens": 2}')
    assert status == 503 and headers["retry-after"] and "shutting down" in text
    rest = stream.read().decode()  # (chunked: the events between chunk sizes)
    assert "data: [DONE]" in rest and '"error"' not in rest
  finally:
    code = s.stop()
  assert code == 0


@pytest.mark.integration
def test_huge_lists_are_refused_at_once_while_health_answers(server):
  """Bodies under --max_body_bytes whose lists the server could never take, three at once and
  then a chat of 140,000 empty messages: each gets its 400 in under a second while /health
  answers within 0.5 s throughout (parsed, validated, tokenized and given a text stream per
  prompt before being counted, the first stalled the event loop for over 10 s)."""
  compact = {"separators": (",", ":")}
  prompts = json.dumps({"prompt": [[1]] * 1_000_000, "max_tokens": 1}, **compact).encode()
  chat = json.dumps({"messages": [{"role": "user", "content": ""}] * 140_000}, **compact).encode()
  assert len(prompts) < 4 * 2**20 and len(chat) < 4 * 2**20
  answers = []

  def send(body: bytes, path: str):
    began = time.monotonic()
    status, _, text = server.request(body, path=path)
    answers.append((status, time.monotonic() - began, json.loads(text)["error"]["message"]))

  with HealthWatch(server) as watch:
    time.sleep(0.3)  # /health answers before the bodies arrive, too
    senders = [threading.Thread(target=send, args=(prompts, "/v1/completions")) for _ in range(3)]
    for sender in senders:
      sender.start()
    for sender in senders:
      sender.join(120)
    send(chat, "/v1/chat/completions")
    time.sleep(0.3)
  assert [status for status, _, _ in answers] == [400] * 4, answers
  assert max(seconds for _, seconds, _ in answers) < 1.0, answers
  assert max(watch.latencies) < 0.5, sorted(watch.latencies)[-5:]


@pytest.mark.integration
def test_a_client_that_writes_its_whole_body_first_reads_the_413_and_headers_are_bounded(server):
  """urllib writes a request's whole body before it reads: over --max_body_bytes (10 MiB
  against 4 MiB), it reads the 413 in OpenAI's shape (the server reads and drops the rest
  first), not a reset connection. A 60 KB header block sent at once gets 431."""
  request = urllib.request.Request(
    f"{server.url}/v1/completions",
    data=b'{"prompt": "' + b"a" * (10 * 2**20) + b'"}',
    headers={"Content-Type": "application/json"},
  )
  with pytest.raises(urllib.error.HTTPError) as refused:
    urllib.request.urlopen(request, timeout=60)
  assert refused.value.code == 413
  assert "--max_body_bytes" in json.loads(refused.value.read())["error"]["message"]
  with socket.create_connection(("127.0.0.1", server.port)) as s:
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000 + b"\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
      reply += s.recv(65536)
  assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]


@pytest.mark.integration
def test_a_second_sigterm_closes_at_once(workdir):
  """The first SIGTERM drains (here up to 300 s), the second closes the server at once: a
  streamed request of 16 choices x 512 tokens over one row, begun before the signals, is cut
  short (no [DONE]) and the process exits 0 within a minute."""
  s = Server(workdir, "--rows=1", "--max_prompt_tokens=16", "--max_new_tokens=512",
             "--shutdown_deadline=300")  # fmt: skip
  try:
    body = {"prompt": "x", "n": 16, "max_tokens": 512, "decoding": "ntp", "stream": True}
    stream = _raw_post(s.port, body, "in-flight").makefile("rb")
    while not stream.readline().startswith(b"data: "):  # it decodes
      pass
    s.process.proc.send_signal(signal.SIGTERM)
    assert _wait(lambda: s.health()[0] == 503, 30)  # draining
    s.process.proc.send_signal(signal.SIGTERM)
    rest = stream.read().decode()
    assert "data: [DONE]" not in rest
    assert s.process.proc.wait(60) == 0
  finally:
    s.stop()


@pytest.mark.integration
def test_ctrl_c_while_compiling_exits_130_in_one_line(workdir):
  """SIGINT while the server compiles what it serves (before its port opens): the process
  exits at once with 130, as a shell reports Ctrl-C, and one line on stderr, where Python's
  KeyboardInterrupt between XLA's calls hung it or ended in a segmentation fault."""
  import subprocess
  import sys

  from xla_env import xla_flags  # tests/ is on sys.path

  from sbd_jax.serving.process import free_port

  command = [sys.executable, "-m", "sbd_jax.serve", f"--workdir={workdir}", f"--port={free_port()}",
             "--max_prompt_tokens=512"]  # fmt: skip
  env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
  proc = subprocess.Popen(
    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
  )
  try:
    first = proc.stdout.readline()
    assert first.startswith("compiling what "), first
    proc.send_signal(signal.SIGINT)
    code = proc.wait(60)
  finally:
    proc.kill()
  assert code == 130
  assert proc.stderr.read().strip().splitlines()[-1] == "error: SIGINT while starting: not serving"
