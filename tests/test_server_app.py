"""The server's engine and application in-process (`serving.engine`, `serving.app`), through
FastAPI's test client: what clients send that a server must survive, liveness, metrics and the
access log. (tests/test_serve.py drives the CLI's process through the openai client.)"""

import asyncio
import io
import json
import logging
import queue
import threading
import time

import numpy as np
import pytest
from decode_helpers import BOS, EOS, peaky_model  # tests/ is on sys.path
from fastapi.testclient import TestClient
from server_helpers import (
  LIMITS,
  MAX_NEW,
  RUN,
  asgi_post,
  complete,
  idle,
  make_client,
  make_engine,
)

from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode import sampler
from sbd_jax.serving import logprobs as logprobs_lib
from sbd_jax.serving import protocol, text_stream
from sbd_jax.serving import requests as requests_lib
from sbd_jax.serving import slots as slots_lib


@pytest.fixture(scope="module")
def model():
  return sampler.SamplingModel.of(peaky_model())


@pytest.fixture(scope="module")
def engine(model):
  e = make_engine(model)
  yield e
  e.drain(0)


@pytest.fixture(scope="module")
def client(engine):
  with make_client(engine) as c:
    yield c


def test_greedy_completion_is_the_decode_and_is_logged_and_counted(client, engine, model, caplog):
  """The text of a greedy (verified) request is `sampler.decode`'s; the response carries the
  client's request id; the access log has one line with its tokens and forwards; /metrics
  counts its tokens under vLLM's names."""
  want = sampler.decode(model, [[BOS, *b"hi"]], RUN.replace(verify=True))
  with caplog.at_level(logging.INFO, logger="sbd_jax.serve.access"):
    r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "req-7"})
  assert r.status_code == 200 and r.headers["x-request-id"] == "req-7"
  body = r.json()
  tokens = [t for t in want.tokens[0] if t != EOS]
  assert body["choices"][0]["text"] == ByteTokenizer().decode(tokens)
  assert body["usage"]["completion_tokens"] == len(tokens)
  assert body["usage"]["forwards"] == want.nfe[0] and "seed" not in body
  assert body["usage"]["rollbacks"] == want.rollbacks[0]
  (line,) = [rec.getMessage() for rec in caplog.records if "request=req-7" in rec.getMessage()]
  assert f"completion_tokens={len(tokens)} forwards={want.nfe[0]} rollbacks=" in line
  metrics = client.get("/metrics").text
  assert "sbd:time_to_first_token_seconds_count" in metrics
  assert "sbd:num_requests_running 0.0" in metrics and "sbd:engine_alive 1.0" in metrics
  (generated,) = [m for m in metrics.splitlines() if m.startswith("sbd:generation_tokens_total")]
  assert float(generated.split()[1]) >= len(tokens)
  value = {m.split()[0]: float(m.split()[1]) for m in metrics.splitlines() if m[:4] == "sbd:"}
  assert value["sbd:rollbacks_total"] >= want.rollbacks[0]
  assert value["sbd:device_forwards"] >= want.nfe[0] - 1  # the prefill runs apart
  # Wide forwards (a block's first pass, or a verified check) over all the device's forwards.
  assert value["sbd:wide_forward_share"] > 0
  assert value["sbd:wide_forward_share"] == pytest.approx(engine.wide_forwards / engine.forwards)
  assert value["sbd:row_occupancy"] == 0  # nothing is decoding now


def metric_values(client) -> dict[str, float]:
  """/metrics' samples, parsed by prometheus_client: {name{labels}: value}."""
  from prometheus_client import parser

  text = client.get("/metrics").text
  return {
    s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
    for family in parser.text_string_to_metric_families(text)
    for s in family.samples
  }


def test_metrics_count_each_request_once_and_equal_the_summed_usage(engine):
  """vLLM's semantics over a mixed run (several prompts, n > 1, SBD and NTP, plain and
  verified, streamed and whole, one refused): the token counters equal the responses' summed
  usage (a prompt counts once, not once per choice), request_success counts requests (not
  choices) and no `*_created` series is exported."""
  bodies = [
    dict(prompt=["hi", "hello"], n=2, max_tokens=6),
    dict(prompt="abc", decoding="ntp", n=3, temperature=1.0, seed=1, max_tokens=5),
    dict(prompt="xy", verify=False, max_tokens=8),
  ]
  with make_client(engine) as c:  # a registry of its own: counters from 0
    usages = [complete(c, **body).json()["usage"] for body in bodies]
    streamed = {"prompt": "hey", "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    with c.stream("POST", "/v1/completions", json=streamed) as r:
      chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages.append(chunks[-1]["usage"])
    assert complete(c, temperature=9).status_code == 400
    value = metric_values(c)
  counted = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "completion_tokens",
    "forwards": "forwards",
    "rollbacks": "rollbacks",
  }
  for counter, field in counted.items():
    assert value[f"sbd:{counter}_total"] == sum(u[field] for u in usages), counter
  # Verified requests report their drafts as vLLM's spec-decode metrics; /metrics sums them.
  spec = [u["spec_decode"] for u in usages if "spec_decode" in u]
  assert len(spec) == 2 and "spec_decode" not in usages[1] and "spec_decode" not in usages[2]
  for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
    assert value[f"sbd:spec_decode_{name}_total"] == sum(x[name] for x in spec), name
  assert value["sbd:spec_decode_num_draft_tokens_total"] > 0
  for pos in range(len(spec[0]["num_accepted_tokens_per_pos"])):
    got = value.get(f"sbd:spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}", 0)
    assert got == sum(x["num_accepted_tokens_per_pos"][pos] for x in spec), pos
  for u in usages[:1] + usages[3:]:
    details, x = u["completion_tokens_details"], u["spec_decode"]
    assert details["accepted_prediction_tokens"] == x["num_accepted_tokens"]
    assert sum(details.values()) == x["num_draft_tokens"]
    assert x["mean_acceptance_length"] == 1 + x["num_accepted_tokens"] / x["num_drafts"]
  assert usages[0]["prompt_tokens"] == len("hi") + len("hello") + 2  # each prompt once, BOS too
  answered = {k: v for k, v in value.items() if k.startswith("sbd:request_success_total")}
  assert sum(answered.values()) == len(usages)
  assert value["sbd:e2e_request_latency_seconds_count"] == len(usages)
  assert not [name for name in value if name.endswith("_created")]


def test_every_request_leaves_one_access_line_with_its_status(engine, caplog):
  """One line per request, whatever its status (200, 400, 401, 404, 405, 413), with its id;
  an X-Request-Id that could forge a line (spaces, '=') is replaced by a new one, in the log
  and in the response."""
  key = {"Authorization": "Bearer k"}
  cases = [
    ("GET", "/health", {}, None, 200),
    ("POST", "/v1/completions", key, {"prompt": "hi", "max_tokens": 2}, 200),
    ("POST", "/v1/completions", key, {"prompt": "hi", "temperature": 9}, 400),
    ("POST", "/v1/completions", {}, {"prompt": "hi"}, 401),
    ("GET", "/nope", {}, None, 404),
    ("GET", "/v1/completions", key, None, 405),
    ("POST", "/v1/completions", key, {"prompt": "x" * 600}, 413),
  ]
  with make_client(engine, api_key="k", max_body_bytes=500) as c:
    with caplog.at_level(logging.INFO, logger="sbd_jax.serve.access"):
      for i, (method, path, headers, body, status) in enumerate(cases):
        r = c.request(method, path, json=body, headers={**headers, "X-Request-Id": f"id-{i}"})
        assert r.status_code == status and r.headers["x-request-id"] == f"id-{i}", (i, r.text)
        assert set(r.json()["error"]) >= {"message", "type"} if status != 200 else True
      forged = "x status=200 request=forged"
      r = c.get("/health", headers={"X-Request-Id": forged})
  lines = [rec.getMessage() for rec in caplog.records if rec.name == "sbd_jax.serve.access"]
  for i, (method, path, _, _, status) in enumerate(cases):
    (line,) = [x for x in lines if x.startswith(f"request=id-{i} ")]
    assert f" method={method} path={path} status={status} " in line
  assert "finish=length prompt_tokens=3 completion_tokens=2" in lines[1]
  assert len(lines) == len(cases) + 1 and not [x for x in lines if "forged" in x]
  assert r.headers["x-request-id"] != forged and lines[-1].startswith(
    f"request={r.headers['x-request-id']} "
  )


def test_the_access_log_prints_each_line_once(client, monkeypatch):
  """`serve.log_access` prints the access log on its stream; a handler on the root logger (as
  absl's, under the CLI) does not print the lines a second time."""
  from sbd_jax import serve

  logger = logging.getLogger("sbd_jax.serve.access")
  monkeypatch.setattr(logger, "propagate", logger.propagate)
  monkeypatch.setattr(logger, "level", logger.level)
  printed, root_printed = io.StringIO(), io.StringIO()
  root_handler = logging.StreamHandler(root_printed)
  logging.getLogger().addHandler(root_handler)
  handler = serve.log_access(printed)
  try:
    client.get("/health", headers={"X-Request-Id": "once"})
  finally:
    logger.removeHandler(handler)
    logging.getLogger().removeHandler(root_handler)
  assert (printed.getvalue() + root_printed.getvalue()).count("request=once ") == 1


def test_unseeded_samples_differ_and_their_reported_seed_replays_them(client):
  texts, seeds = [], []
  for _ in range(2):
    r = complete(client, temperature=1.0, decoding="ntp").json()
    texts.append(r["choices"][0]["text"])
    seeds.append(r["seed"])
  assert seeds[0] != seeds[1] and texts[0] != texts[1]
  replay = complete(client, temperature=1.0, decoding="ntp", seed=seeds[1]).json()
  assert replay["choices"][0]["text"] == texts[1] and replay["seed"] == seeds[1]


@pytest.mark.integration
def test_temperatures_and_verification_are_per_row_and_share_one_pool(model):
  """SBD requests, greedy and sampled, verified and plain, sent together, decode in one pool (no
  pool per temperature or verification) and each answers what a decode alone with its settings
  gives: a verified one NTP's text, with its rollbacks counted. (Without pauses: with them a
  verified row's forwards are its batch's choice, its text not.)"""
  engine = make_engine(model, max_pools=1)
  run = RUN.replace(adaptive=False)
  cases = [(0.0, True), (0.5, False), (1.5, True), (0.0, False)]
  bodies = {}
  with make_client(engine, run_settings=run) as client:
    threads = [
      threading.Thread(
        target=lambda t=t, v=v: bodies.__setitem__(
          (t, v), complete(client, temperature=t, seed=3, verify=v).json()
        )
      )
      for t, v in cases
    ]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    assert len(engine.pools) == 1
  engine.drain(0)
  for (t, v), body in bodies.items():
    alone = sampler.decode(model, [[BOS, *b"hi"]], run.replace(temperature=t, verify=v), seed=3)
    want = ByteTokenizer().decode([x for x in alone.tokens[0] if x != EOS])
    assert body["choices"][0]["text"] == want, (t, v)
    assert body["usage"]["forwards"] == alone.nfe[0], (t, v)
    assert body["usage"]["rollbacks"] == (alone.rollbacks[0] if v else 0), (t, v)


def test_a_request_that_can_never_fit_the_queue_gets_400_with_the_limit(
  client, engine, monkeypatch
):
  """More choices (prompts x n) than --max_queue can never be queued: 400 naming the limit, not
  a 503 the client would retry; a request at the limit is taken, all or none of its choices."""
  for body in ({"prompt": ["a"] * 300}, {"prompt": ["a"] * 17, "n": 16}):
    r = complete(client, max_tokens=1, **body)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "--max_queue=256" in message and "retry-after" not in r.headers
  monkeypatch.setattr(engine, "max_queue", 4)
  assert complete(client, prompt=["a", "b"], n=2, max_tokens=1).status_code == 200
  r = complete(client, prompt=["a", "b", "c"], n=2, max_tokens=1)
  assert r.status_code == 400 and "6 choices (prompts x n)" in r.json()["error"]["message"]
  assert engine.waiting() == 0


def test_seeds_are_int64_as_openais_and_best_of_1_is_accepted(client):
  """Any int64 seed samples, replays and is reported as sent; one of 2^32 or more is not its
  low 32 bits; past int64: 400. best_of=1 is accepted, any other value refused in one line."""
  body = dict(temperature=1.0, decoding="ntp")
  texts = {}
  for seed in (2**40, 2**40, 0, -5, 2**63 - 1):
    r = complete(client, seed=seed, **body).json()
    assert r["seed"] == seed
    texts.setdefault(seed, []).append(r["choices"][0]["text"])
  assert texts[2**40][0] == texts[2**40][1] != texts[0][0]
  assert protocol.key_seed(7) == 7 and 0 <= protocol.key_seed(-(2**63)) < 2**32
  assert complete(client, seed=2**63, **body).status_code == 400
  assert complete(client, best_of=1, max_tokens=2).status_code == 200
  for bad, message in ((dict(best_of=2), "best_of=2 is not supported"), (dict(best_of=1, n=2),
                       "best_of=1 is less than n=2")):  # fmt: skip
    r = complete(client, max_tokens=2, **bad)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message)


def test_n_choices_are_rows_of_the_request_drawn_as_a_list_of_prompts(client):
  """n = 3 choices of one prompt draw as the same prompt given three times: choice j with the
  key (seed, j); greedy choices are all alike."""
  body = dict(temperature=1.0, decoding="ntp", seed=11, max_tokens=8)
  three = complete(client, n=3, **body).json()
  listed = complete(client, prompt=["hi"] * 3, **body).json()
  texts = [c["text"] for c in three["choices"]]
  assert [c["index"] for c in three["choices"]] == [0, 1, 2]
  assert texts == [c["text"] for c in listed["choices"]] and len(set(texts)) > 1
  assert three["usage"]["prompt_tokens"] == len("hi") + 1  # the prompt counts once
  greedy = complete(client, n=2, max_tokens=8).json()["choices"]
  assert greedy[0]["text"] == greedy[1]["text"]


@pytest.mark.parametrize(
  "raw, message",
  [
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "hi", "temperature": 1e-45}', "use 0 (greedy) or at least"),
    (b'{"prompt": "hi", "temperature": 2.5}', "temperature"),
    (b'{"prompt": "hi", "gamma": 1e999}', "gamma"),
    (b'{"prompt": "hi", "logit_bias": {"5": 3}}', "logit_bias"),
    (b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}', "at most 8"),
    (b'{"prompt": "hi", "stop": "' + b"s" * 300 + b'"}', "at most 256 characters"),
    (b'{"prompt": "hi", "suffix": "x"}', "suffix is not supported"),
  ],
)
def test_values_a_decode_cannot_honour_get_400_and_one_line(client, raw, message):
  r = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
  error = r.json()["error"]["message"]
  assert r.status_code == 400 and message in error and "\n" not in error


class PickyTokenizer(ByteTokenizer):
  """Raises on a BEL character, as a tokenizer may on text it cannot take."""

  def encode(self, text):
    if "\x07" in text:
      raise TypeError("cannot take it")
    return super().encode(text)


def test_text_the_tokenizer_cannot_take_gets_400_with_openais_body(engine):
  """A lone surrogate (JSON's "\\ud800") in a prompt or in chat content, text the tokenizer
  raises on, or a conversation the chat template refuses: 400 with OpenAI's body, one line and
  the request id, not a 500; what does not encode as UTF-8 is never tokenized."""
  from sbd_jax.data.chat import ChatTemplate

  template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
  with make_client(engine, tokenizer=PickyTokenizer(), template=template) as c:
    cases = [
      ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "not valid Unicode"),
      ("/v1/completions", b'{"prompt": ["ok", "a\\udfff"]}', "not valid Unicode"),
      ("/v1/completions", b'{"prompt": "a\\u0007"}', "prompt: the tokenizer cannot encode it"),
      ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
       "messages[0].content: not valid Unicode"),
      ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", '
       b'"text": "a\\u0007"}]}]}', "messages: the tokenizer cannot encode it"),
    ]  # fmt: skip
    for path, raw, message in cases:
      headers = {"Content-Type": "application/json", "X-Request-Id": "bad-text"}
      r = c.post(path, content=raw, headers=headers)
      error = r.json()["error"]["message"]
      assert r.status_code == 400 and message in error and "\n" not in error, (raw, r.text)
      assert r.headers["x-request-id"] == "bad-text"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert c.post("/v1/chat/completions", json=chat).status_code == 200
  refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", {}, source="t")
  with make_client(engine, template=refusing) as c:
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]


class CountingTokenizer(ByteTokenizer):
  """Counts the texts it encodes; given `release`, each waits for it (at most 30 s) and notes
  whether it came."""

  def __init__(self, release: threading.Event | None = None):
    self.encoded, self.release, self.released = [], release, []

  def encode(self, text):
    self.encoded.append(len(text))
    if self.release is not None:
      self.released.append(self.release.wait(30))
    return super().encode(text)


def test_a_body_over_the_limit_gets_413_before_it_is_parsed(engine):
  """--max_body_bytes: a larger body gets 413 in OpenAI's shape, by its Content-Length or,
  sent without one (chunked), by the bytes that arrive; malformed JSON over the limit is
  never parsed (413, not 400); a body within the limit is served."""
  with make_client(engine, max_body_bytes=200) as c:
    over = b'{"prompt": "' + b"a" * 300
    r = c.post("/v1/completions", content=over, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max_body_bytes=200" in r.json()["error"]["message"]
    chunked = c.post("/v1/completions", content=iter([over[:150], over[150:]]))
    assert "content-length" not in chunked.request.headers and chunked.status_code == 413
    assert complete(c, max_tokens=2).status_code == 200


def test_prompt_text_is_bounded_in_characters_before_it_is_tokenized(engine):
  """Text longer than --max_prompt_tokens tokens can spell (the byte tokenizer: one character
  per token at most) is refused before the tokenizer sees it, in a completion or a chat; a
  prompt at the bound is tokenized and served."""
  from sbd_jax.data.chat import ChatTemplate

  tokenizer = CountingTokenizer()
  template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
  with make_client(engine, tokenizer=tokenizer, template=template) as c:
    r = complete(c, prompt=["ok", "x" * (LIMITS.max_prompt_tokens + 1)])
    chat = {"messages": [{"role": "user", "content": "y" * 20}] * 2}
    r_chat = c.post("/v1/chat/completions", json=chat)
    for reply in (r, r_chat):
      message = reply.json()["error"]["message"]
      assert reply.status_code == 400 and "characters, more than --max_prompt_tokens=32" in message
    assert tokenizer.encoded == [2]  # "ok" only: each prompt is checked before it is encoded
    at_bound = "x" * (LIMITS.max_prompt_tokens - 1)  # + BOS: max_prompt_tokens tokens
    assert complete(c, prompt=at_bound, max_tokens=2).status_code == 200


def test_tokenizing_runs_off_the_event_loop(engine):
  """While a prompt is being tokenized, the server answers other clients: /health returns
  before the tokenizer is let go (were it on the event loop, /health would wait for it)."""
  release = threading.Event()
  tokenizer = CountingTokenizer(release)
  with make_client(engine, tokenizer=tokenizer) as c:
    replies = []
    asking = threading.Thread(target=lambda: replies.append(complete(c, max_tokens=2)))
    asking.start()
    while not tokenizer.encoded:
      time.sleep(0.005)
    assert c.get("/health").status_code == 200
    release.set()
    asking.join(60)
  assert tokenizer.released == [True] and replies[0].status_code == 200


def test_an_unhandled_failure_is_a_500_in_openais_shape_with_the_id(client, monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("a bug")

  monkeypatch.setattr(protocol, "decoding", broken)
  r = client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "bug"})
  assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
  assert r.headers["x-request-id"] == "bug"


def test_common_fields_at_their_defaults_are_accepted(client):
  assert complete(client, logit_bias={}, suffix="", max_tokens=2).status_code == 200
  r = client.post(
    "/v1/chat/completions",
    json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
          "response_format": {"type": "text"}},
  )  # fmt: skip
  assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_errors_have_openais_body_for_every_status(client):
  for method, path, status in [("GET", "/nope", 404), ("GET", "/v1/completions", 405)]:
    r = client.request(method, path)
    assert r.status_code == status and set(r.json()["error"]) >= {"message", "type"}
  assert client.get("/v1/models/m").json()["id"] == "m"
  r = client.get("/v1/models/other")
  assert r.status_code == 404 and "'other' is not served" in r.json()["error"]["message"]


def test_a_model_other_than_the_one_served_gets_404_model_not_found(client):
  """As OpenAI and vLLM answer it: 404, code model_not_found, param model; the served name
  (/v1/models) or none at all decodes."""
  chat = {"messages": [{"role": "user", "content": "hi"}]}
  for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
    r = client.post(path, json={**body, "model": "gpt-4o", "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found", r.text
    assert error["param"] == "model" and "'gpt-4o' is not served" in error["message"]
  assert client.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
  (served,) = client.get("/v1/models").json()["data"]
  for name in (served["id"], None):
    assert complete(client, model=name, max_tokens=2).status_code == 200


def test_an_api_key_guards_v1_only(model):
  engine = make_engine(model)
  with make_client(engine, api_key="s3cret") as c:
    r = complete(c, max_tokens=2)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    ok = c.post(
      "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
      headers={"Authorization": "Bearer s3cret"},
    )  # fmt: skip
    assert ok.status_code == 200 and c.get("/health").status_code == 200
  engine.drain(0)


def events_of(engine, settings, max_tokens=MAX_NEW, prompt=(BOS, 72, 105), on_event=None):
  """Submit one request; returns the queue its events arrive on."""
  q = queue.Queue()

  def emit(event):
    q.put(event)
    if on_event is not None:
      on_event(event)

  request = requests_lib.Request(list(prompt), settings, 0.35, max_tokens, 0, emit)
  engine.submit(request)
  return request, q


def finished(q, timeout=120) -> requests_lib.Finished:
  deadline = time.monotonic() + timeout
  while True:
    event = q.get(timeout=max(0.1, deadline - time.monotonic()))
    if isinstance(event, requests_lib.Finished):
      return event


def served(settings):
  return settings.replace(lockstep=False, refill=True, gamma=1.0, max_new_tokens=MAX_NEW)


def test_the_engine_refuses_a_prompt_longer_than_its_pools_take(engine, model):
  """A prompt longer than max_prompt_tokens would be written past its cache's prompt slots (a
  silently wrong decode): submit refuses it in one line and queues nothing; a prompt of exactly
  max_prompt_tokens decodes as `sampler.decode` does."""
  s = served(RUN.replace(mode="ntp"))
  longest = [BOS] + [5 + i % 50 for i in range(LIMITS.max_prompt_tokens - 1)]
  for prompt in ([*longest, 6], []):
    request = requests_lib.Request(prompt, s, 0.35, 4, 0, emit=lambda event: None)
    with pytest.raises(ValueError, match=r"^a prompt of \d+ tokens: the pools take 1 to max_pro"):
      engine.submit(request)
  assert engine.waiting() == 0
  _, q = events_of(engine, s, max_tokens=4, prompt=longest)
  tokens = []
  while not isinstance(event := q.get(timeout=120), requests_lib.Finished):
    tokens += event
  want = sampler.decode(model, [longest], RUN.replace(mode="ntp", max_new_tokens=4)).tokens[0]
  assert tokens == [t for t in want if t != EOS]


def test_an_event_callback_that_raises_ends_its_own_request_only(model):
  engine = make_engine(model)
  try:

    def broken(event):
      raise RuntimeError("the client's callback broke")

    request = requests_lib.Request([BOS, 5], served(RUN), 0.35, MAX_NEW, 0, broken)
    engine.submit(request)
    _, q = events_of(engine, served(RUN))
    assert finished(q).reason in ("stop", "length")
    assert engine.alive() and engine.finished["error"] == 1
  finally:
    engine.drain(0)


def test_cancelled_rows_stop_decoding_on_device(model):
  """Two rows cancelled at their first tokens, then one short request in row 0: row 1 spends
  no forward after its cancellation (it is evicted at the next device call)."""
  engine = make_engine(model, forwards_per_call=1)
  try:
    s = served(RUN.replace(mode="ntp"))
    long = [events_of(engine, s, on_event=lambda e: None) for _ in range(2)]
    for request, q in long:
      q.get(timeout=120)  # a first token
      request.cancel()
    for _, q in long:
      assert finished(q).reason == "cancelled"
    (pool,) = engine.pools.values()
    nfe_at_cancel = pool.slots.rows.nfe_B[1]
    _, q = events_of(engine, s, max_tokens=4)
    assert finished(q).reason == "length"
    assert pool.slots.rows.nfe_B[1] == nfe_at_cancel
  finally:
    engine.drain(0)


def test_max_pools_is_a_hard_limit_and_other_settings_wait(model):
  engine = make_engine(model, max_pools=1)
  try:
    first, q1 = events_of(engine, served(RUN))
    _, q2 = events_of(engine, served(RUN.replace(mode="ntp")), max_tokens=4)
    assert len(engine.pools) <= 1
    assert finished(q1).reason in ("stop", "length") and finished(q2).reason == "length"
    assert len(engine.pools) == 1
  finally:
    engine.drain(0)


def test_a_failing_pool_answers_error_and_a_dead_device_stops_the_engine(model, monkeypatch):
  """One failed device call: that pool's requests end "error" (HTTP 500) and the engine serves
  the next. Every call failing: after max_failures passes the engine stops, /health answers
  503 with Retry-After, new requests get 503, and the server's failure hook runs."""
  failures = []
  engine = make_engine(model, max_failures=2, on_failure=failures.append)
  real_advance = slots_lib.advance
  broken = {"calls": 1}

  def advance(*args, **kwargs):
    if broken["calls"]:
      broken["calls"] -= 1
      raise RuntimeError("RESOURCE_EXHAUSTED: injected")
    return real_advance(*args, **kwargs)

  monkeypatch.setattr(slots_lib, "advance", advance)
  with make_client(engine) as c:
    r = complete(c, max_tokens=4)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert complete(c, max_tokens=4).status_code == 200 and c.get("/health").status_code == 200
    broken["calls"] = 10**6
    assert complete(c, max_tokens=4).status_code == 500
    deadline = time.monotonic() + 60
    while engine.error is None and time.monotonic() < deadline:
      if complete(c, max_tokens=4).status_code == 503:
        break
    health = c.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert health.headers["retry-after"]
    r = complete(c, max_tokens=4)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert len(failures) == 1 and "device is gone" in str(failures[0])


def hang_until(release: threading.Event, fn):
  """`fn` that first waits for `release` (at most 60 s): a device call or pool that hangs."""

  def hung(*args, **kwargs):
    release.wait(60)
    return fn(*args, **kwargs)

  return hung


def test_a_hung_device_step_fails_the_engine(model, monkeypatch, caplog):
  """The watchdog: a device call that does not return within step_timeout_s fails the engine
  from its own thread (the engine's is stuck): the waiting request gets 500, /health 503, the
  failure hook runs. When the stuck call returns, after the server has stopped (its event loop
  closed), the engine thread stops without sending anything more: no callback fails."""
  failures = []
  engine = make_engine(model, step_timeout_s=120, on_failure=failures.append)
  release = threading.Event()
  with make_client(engine) as c:
    assert complete(c, max_tokens=4).status_code == 200  # compiles (within the limit)
    engine.step_timeout_s = 0.5
    assert complete(c, max_tokens=4).status_code == 200  # steps within the limit
    monkeypatch.setattr(slots_lib, "advance", hang_until(release, slots_lib.advance))
    r = complete(c, max_tokens=4)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    health = c.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert len(failures) == 1 and "ran for more than 0.5 s" in str(failures[0])
  caplog.clear()
  with caplog.at_level(logging.ERROR, logger="sbd_jax.serving.engine"):
    release.set()
    engine._thread.join(timeout=30)
  assert not engine._thread.is_alive()
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_watchdog_covers_making_a_pool(model, monkeypatch):
  """Making a pool on first use (its caches allocated, its step compiled) counts as a step: one
  that runs past step_timeout_s fails the engine (the request 500, /health 503) instead of
  leaving /health at 200 while nothing decodes."""
  failures = []
  engine = make_engine(model, step_timeout_s=0.5, on_failure=failures.append)
  release = threading.Event()
  monkeypatch.setattr(slots_lib, "init", hang_until(release, slots_lib.init))
  try:
    with make_client(engine) as c:
      r = complete(c, max_tokens=2)
      assert r.status_code == 500 and c.get("/health").json()["status"] == "failed"
    assert len(failures) == 1 and "ran for more than 0.5 s" in str(failures[0])
  finally:
    release.set()
    engine._thread.join(timeout=30)
  assert not engine._thread.is_alive()


def slowed_device(monkeypatch, seconds: float = 0.02):
  """Every device call takes `seconds` longer: tokens keep arriving, a call's worth at a time."""
  real_advance = slots_lib.advance

  def slow(*args, **kwargs):
    time.sleep(seconds)
    return real_advance(*args, **kwargs)

  monkeypatch.setattr(slots_lib, "advance", slow)


# 16 greedy choices of MAX_NEW NTP tokens over the module engine's 2 rows: 8 waves of at least
# 5 device calls each, so at least 0.8 s on the slowed device, tokens arriving all the while.
SIXTEEN = {"prompt": "hi", "n": 16, "max_tokens": MAX_NEW, "decoding": "ntp"}


def test_the_request_timeout_fires_while_tokens_flow(engine, monkeypatch):
  """--request_timeout holds however fast tokens arrive: a streamed request ends with a timeout
  event (no [DONE]), a whole one gets 504, their rows are freed, and neither counts as a
  success."""
  with make_client(engine) as warm:
    assert complete(warm, **{**SIXTEEN, "n": 1}).status_code == 200  # compiled: no compile counts
  slowed_device(monkeypatch)
  with make_client(engine, request_timeout_s=0.3) as c:
    with c.stream("POST", "/v1/completions", json={**SIXTEEN, "stream": True}) as r:
      lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1][6:])["error"]["type"] == "timeout" and "data: [DONE]" not in lines
    r = complete(c, **SIXTEEN)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    value = metric_values(c)
  assert value["sbd:request_failure_total{reason=timeout}"] == 2
  assert not [k for k in value if k.startswith("sbd:request_success_total")]
  idle(engine)
  assert engine.busy_rows() == 0 and engine.alive()


def test_a_client_that_leaves_cancels_its_choices_while_tokens_flow(engine, monkeypatch, caplog):
  """A client that hangs up while tokens flow (streamed or not) cancels every choice of its
  request at once; the access log has its line (status 499 when no response had begun)."""
  with make_client(engine) as warm:
    assert complete(warm, **{**SIXTEEN, "n": 1}).status_code == 200  # compiled
  slowed_device(monkeypatch)
  app = make_client(engine).app

  async def leave(body):
    left = asyncio.Event()
    call = asyncio.ensure_future(asgi_post(app, body, left, [(b"x-request-id", b"leaves")]))
    while engine.busy_rows() == 0:  # its first choices decode
      await asyncio.sleep(0.005)
    left.set()
    return await asyncio.wait_for(call, 60)

  for stream in (False, True):
    before = engine.finished["cancelled"]
    with caplog.at_level(logging.INFO, logger="sbd_jax.serve.access"):
      asyncio.run(leave({**SIXTEEN, "stream": stream}))
    idle(engine)  # (a stream's response ends before the engine has seen the cancellations)
    # Two rows: at most the two choices decoding and the two that replace them at the next
    # step finish before the engine sees the cancellation; the other twelve never decode.
    assert engine.finished["cancelled"] - before >= 12, stream
    (line,) = [r.getMessage() for r in caplog.records if "request=leaves " in r.getMessage()]
    assert f"status={200 if stream else 499} finish=" in line and "cancelled" in line
    caplog.clear()
  assert engine.alive()


def test_requests_unfinished_at_the_drain_deadline_get_503_not_an_answer(model):
  engine = make_engine(model, forwards_per_call=1)
  with make_client(engine) as c:
    replies = []
    started = threading.Event()

    def ask():
      started.set()
      replies.append(complete(c, max_tokens=MAX_NEW, decoding="ntp"))

    t = threading.Thread(target=ask)
    t.start()
    started.wait()
    while engine.busy_rows() == 0 and not replies:
      time.sleep(0.005)
    engine.drain(0)
    t.join(60)
  (r,) = replies
  if r.status_code == 200:  # it finished before the drain: nothing to show
    pytest.skip("the request finished before the drain began")
  assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]


def test_stop_strings_and_split_characters_across_chunks():
  """The text sent never holds half a UTF-8 character or a stop string's beginning that the
  next tokens could complete; a stop string split across chunks still cuts the text."""
  stream = text_stream.TextStream(ByteTokenizer(), ["STOP"])
  euro = list("€".encode())
  sent = [stream.add([*b"ab", euro[0]]), stream.add(euro[1:] + [*b"xS"]), stream.add([*b"TO"])]
  assert sent == ["ab", "€x", ""]
  assert stream.add([*b"P tail"]) == "" and stream.stopped and stream.finish() == ""
  assert stream.kept_tokens == len("ab€xSTOP".encode())  # through the "P", not " tail"
  plain = text_stream.TextStream(ByteTokenizer(), ["zz"])
  assert plain.add([*b"a z"]) == "a " and plain.finish() == "z"
  assert json.loads(json.dumps(plain.sent)) == "a z" and plain.kept_tokens is None


def test_stop_token_ids_end_the_text_before_them(client, model):
  """A stop token id ends a choice as EOS does, its own text not sent (held-back text before
  it is); from the request or the server's --stop_token_ids; ids outside the vocabulary: 400."""
  stream = text_stream.TextStream(ByteTokenizer(), ["zz"], stop_ids=[ord("!")])
  assert stream.add([*b"ab z"]) == "ab " and stream.add([*b"c!de"]) == "zc" and stream.stopped
  assert stream.finish() == "" and stream.sent == "ab zc" and stream.kept_tokens == 5
  stopped_by_string = text_stream.TextStream(ByteTokenizer(), ["b"], stop_ids=[ord("!")])
  assert stopped_by_string.add([*b"abc!"]) == "a" and stopped_by_string.sent == "a"
  assert stopped_by_string.kept_tokens == 2

  plain = RUN.replace(verify=False)
  tokens = [t for t in sampler.decode(model, [[BOS, *b"hi"]], plain).tokens[0] if t != EOS]
  stop_id = tokens[2]
  want = ByteTokenizer().decode(tokens[: tokens.index(stop_id)])
  r = complete(client, max_tokens=MAX_NEW, verify=False, stop_token_ids=[stop_id]).json()
  assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
  # The tokens before the stop id, not the rest of the block the decode had settled.
  assert r["usage"]["completion_tokens"] == tokens.index(stop_id)
  engine = make_engine(model)
  with make_client(engine, stop_token_ids=(stop_id,)) as server_wide:
    r = complete(server_wide, max_tokens=MAX_NEW, verify=False).json()
    assert r["choices"][0]["text"] == want
  engine.drain(0)
  r = complete(client, stop_token_ids=[260])
  assert r.status_code == 400 and "stop_token_ids [260] are outside [0, 260)" in r.text


def test_logprobs_of_the_chosen_tokens_streamed_or_whole(client, model):
  """logprobs=0: each sent token with its log-probability (a row's, `test_slots` checks them
  against an uncached forward) and text offset; the tokens spell the text, streamed or not.
  Top alternatives are refused in one line."""
  body = dict(prompt="hi", max_tokens=MAX_NEW, decoding="ntp", logprobs=0)
  whole = complete(client, **body).json()["choices"][0]
  lp = whole["logprobs"]
  assert "".join(lp["tokens"]) == whole["text"] and len(lp["tokens"]) > 2
  assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
  assert all(x is not None and x <= 0 for x in lp["token_logprobs"]) and lp["top_logprobs"] is None
  greedy = [t for t in sampler.decode(model, [[BOS, *b"hi"]], RUN.replace(mode="ntp")).tokens[0]]
  assert whole["text"] == ByteTokenizer().decode([t for t in greedy if t != EOS])

  with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
  streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
  assert sum((x["tokens"] for x in streamed), []) == lp["tokens"]
  assert sum((x["token_logprobs"] for x in streamed), []) == lp["token_logprobs"]

  chat = client.post(
    "/v1/chat/completions",
    json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_tokens": 4},
  )
  assert chat.status_code == 400  # this tokenizer has no chat template: the check comes first
  for bad, message in (
    (dict(logprobs=2), "logprobs=2: only the chosen tokens' log-probabilities are served"),
    (dict(echo=True, logprobs=0), "loglikelihood scoring (echo) is not served"),
  ):
    r = complete(client, **bad)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
  entries = [("a", -0.5, 0), ("\u20ac", float("nan"), 1)]
  assert logprobs_lib.chat(entries)["content"][1] == {
    "token": "\u20ac", "logprob": None, "bytes": [226, 130, 172], "top_logprobs": []
  }  # fmt: skip


def test_unseeded_greedy_requests_keep_seed_zero():
  assert protocol.request_seed(None, 0.0) == 0 and protocol.request_seed(7, 0.8) == 7
  assert len({protocol.request_seed(None, 0.8) for _ in range(4)}) == 4
  assert np.iinfo(np.uint32).max >= protocol.request_seed(None, 0.8) >= 0


def test_after_a_pools_first_request_nothing_compiles(model):
  """The pool is made with its decode step compiled and its rows placed as every later call
  sees them: neither the next request alone nor two admitted together compile again (the
  first request after a warm-up once waited for a second compile of the admission). The
  weights are placed on a one-device mesh, as a loaded run's are."""
  import jax

  from sbd_jax import sharding

  placed = model.sharded(sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
  engine = make_engine(placed)
  try:
    s = served(RUN.replace(block_size=2))
    assert finished(events_of(engine, s)[1]).reason in ("stop", "length")
    warm = engine.compilations()
    assert finished(events_of(engine, s)[1]).reason in ("stop", "length")
    pair = [events_of(engine, s)[1] for _ in range(2)]
    assert all(finished(q).reason in ("stop", "length") for q in pair)
    assert engine.compilations() == warm
  finally:
    engine.drain(0)


def test_the_server_decodes_only_what_it_compiled_at_start_up(model):
  """By default (serving.server): NTP and the run's own SBD setting, every pool made and every
  prompt bucket compiled before `start` returns; a request then compiles nothing (plain and
  verified, greedy and sampled rows, the largest bucket), and another block size or rule gets
  400 naming what is served: no client makes the engine stop to compile. --block_sizes /
  --rules add settings; --compile_on_demand serves any, made on first use."""
  from sbd_jax.serving import server

  options = dict(rows=2, max_queue=8, forwards_per_call=2, decoding="sbd")
  app, engine = server.start(model, ByteTokenizer(), RUN, LIMITS, options, model_name="m")
  assert [protocol.describe(s) for s in engine.pools] == [
    "ntp", "sbd block_size=4 rule=eb_entropy",
  ]  # fmt: skip
  before = engine.compilations()
  with TestClient(app) as client:
    for body in (
      dict(decoding="ntp"), dict(verify=True), dict(verify=False, temperature=0.5, seed=1),
      dict(prompt="x" * 30),  # the largest bucket
    ):  # fmt: skip
      assert complete(client, **body).status_code == 200, body
    assert engine.compilations() == before
    for other in (dict(block_size=2), dict(rule="threshold")):
      r = complete(client, **other)
      assert r.status_code == 400 and r.json()["error"]["message"] == (
        "this server decodes only what it compiled: ntp; sbd block_size=4 rule=eb_entropy "
        "(--block_sizes / --rules add more)"
      )
    assert engine.compilations() == before
  engine.drain(0)
  allowed = protocol.allowed_pools(RUN, LIMITS, [2], ["threshold"])
  assert [protocol.describe(s) for s in allowed] == [
    "ntp", "sbd block_size=4 rule=eb_entropy", "sbd block_size=2 rule=threshold",
  ]  # fmt: skip
  assert server.served_pools(RUN, LIMITS, [], [], compile_on_demand=True) == []
  with pytest.raises(ValueError, match="max_pools=2 is fewer than the 3 pools"):
    make_engine(model, serve_only=allowed, max_pools=2)
  with pytest.raises(ValueError, match="--block_sizes: 8 is outside the blocks"):
    protocol.allowed_pools(RUN, LIMITS, [8], [])


def test_a_verified_pool_times_its_forwards_when_made_and_learns_what_its_rows_accept(
  model, caplog
):
  """With measured costs (`wide_cost=0`, the default) a verified pool times NTP's forward and a
  wide forward of each draft width at its own batch size when it is made (and says so in the
  log), chooses its forwards by them, and its finished rows' acceptance becomes the prior of
  the rows after them; the text stays NTP's."""
  engine = make_engine(model)
  try:
    s = served(RUN.replace(wide_cost=0.0))
    q = queue.Queue()
    with caplog.at_level(logging.INFO, logger="sbd_jax.decode.costs"):
      engine.submit(requests_lib.Request([BOS, *b"hi"], s, 0.35, MAX_NEW, 0, q.put, verify=True))
      done = finished(q)
    (pool,) = engine.pools.values()
    assert pool.costs.kinds == ("ntp", "2x2", "2x4") and pool.costs.source in ("measured", "reused")
    assert pool.costs.rows == 2 and all(t > 0 for t in pool.costs.seconds)
    assert any("2 rows on" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(pool.tuning.cost_K, pool.costs.cost_K)
    assert done.drafts > 0 and pool.prior.learned
    assert pool.prior.tried.sum() - pool.prior.rejected.sum() == done.accepted_tokens
    np.testing.assert_allclose(pool.tuning.prior_P, pool.prior.by_position(s.block_size))
  finally:
    engine.drain(0)
