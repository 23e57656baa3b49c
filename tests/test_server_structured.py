"""Structured output at the server (`serving.structured`, `serving.pool_tables`), in-process:
OpenAI's response_format and vLLM's structured_outputs decode within their constraint on an
untrained model, token for token the library's constrained decode; rows with different
constraints and none share one batch of one pool, and a new constraint compiles nothing; bad
constraints get 400 with OpenAI's body, one line, naming the field; a schema that cannot finish
within max_tokens ends "length", noted incomplete; a server without structured output refuses."""

import collections
import concurrent.futures
import dataclasses
import json
import re
import threading
import time

import jsonschema
import pytest
from decode_helpers import BOS, EOS, peaky_model  # tests/ is on sys.path
from fastapi.testclient import TestClient
from server_helpers import LIMITS, MAX_NEW, RUN, complete, make_client

from sbd_jax.constrain.spec import Constraint
from sbd_jax.data.chat import ChatTemplate
from sbd_jax.data.tokenizer import ByteTokenizer
from sbd_jax.decode import sampler
from sbd_jax.serving import pool as pool_lib
from sbd_jax.serving import protocol, server

TOKENIZER = ByteTokenizer()
STRUCTURED = dataclasses.replace(LIMITS, structured_output=True)
ROWS = 3
# Its shortest text, {"a":true}, and EOS fit MAX_NEW tokens (keys and punctuation forced).
FLAG = {
  "type": "object",
  "properties": {"a": {"type": "boolean"}},
  "required": ["a"],
  "additionalProperties": False,
}
# Its shortest text does not.
LONG = {
  "type": "object",
  "properties": {"a_long_property_name": {"type": "integer"}},
  "required": ["a_long_property_name"],
}


def _schema_format(schema, **extra):
  return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}


@pytest.fixture(scope="module")
def model():
  return sampler.SamplingModel.of(peaky_model())


@pytest.fixture(scope="module")
def started(model):
  """A server as `serve` starts one (its pools, NTP's and the run's SBD, made and compiled
  constrained before it serves), with a chat template."""
  options = dict(rows=ROWS, max_queue=16, forwards_per_call=2, decoding="sbd")
  template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {})
  app, engine = server.start(
    model, TOKENIZER, RUN, STRUCTURED, options, template=template, model_name="m"
  )
  yield app, engine
  engine.drain(0)


@pytest.fixture(scope="module")
def client(started):
  with TestClient(started[0], raise_server_exceptions=False) as c:
    yield c


def _choice(r) -> dict:
  assert r.status_code == 200, r.text
  (choice,) = r.json()["choices"]
  return choice


def _refused(r, param: str, *fragments: str) -> str:
  """A 400 with OpenAI's error body: one line, naming `param`."""
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["type"] == "invalid_request_error" and error["param"] == param, error
  assert "\n" not in error["message"] and all(f in error["message"] for f in fragments), error
  return error["message"]


@pytest.mark.integration
def test_a_json_schema_on_chat_returns_valid_json(client):
  """response_format json_schema (strict) on chat: the untrained model's text validates, noted
  complete, its forced tokens counted in the usage; streamed, the last chunk carries the note."""
  body = {
    "messages": [{"role": "user", "content": "hi"}],
    "response_format": _schema_format(FLAG, strict=True),
  }
  choice = _choice(r := client.post("/v1/chat/completions", json=body))
  jsonschema.validate(json.loads(choice["message"]["content"]), FLAG)
  assert choice["finish_reason"] == "stop" and choice["structured_output"] == {"complete": True}
  assert r.json()["usage"]["forced_tokens"] >= len('{"a":}')
  body.update(stream=True, stream_options={"include_usage": True})
  with client.stream("POST", "/v1/chat/completions", json=body) as s:
    events = [json.loads(line[6:]) for line in s.iter_lines() if line[6:] not in ("", "[DONE]")]
  last = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
  assert last == [{**last[0], "structured_output": {"complete": True}}]
  text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
  assert text == choice["message"]["content"] and "forced_tokens" in events[-1]["usage"]


def test_completions_take_regexes_choices_and_json_objects(client):
  """structured_outputs' regex and choice, response_format on completions too: matched."""
  for decoding in ("sbd", "ntp"):
    pattern = "[0-9]{3}-[a-c]{2}"
    choice = _choice(complete(client, structured_outputs={"regex": pattern}, decoding=decoding))
    assert re.fullmatch(pattern, choice["text"]) and choice["finish_reason"] == "stop"
    options = ["yes", "no", "maybe not"]
    choice = _choice(complete(client, structured_outputs={"choice": options}, decoding=decoding))
    assert choice["text"] in options and choice["structured_output"] == {"complete": True}
  choice = _choice(complete(client, response_format=_schema_format(FLAG)))
  jsonschema.validate(json.loads(choice["text"]), FLAG)
  choice = _choice(complete(client, structured_outputs={"json": json.dumps(FLAG)}))
  jsonschema.validate(json.loads(choice["text"]), FLAG)
  # Unconstrained requests carry no note, and text is no constraint.
  for body in ({}, {"response_format": {"type": "text"}}):
    choice = _choice(r := complete(client, **body))
    assert "structured_output" not in choice and "forced_tokens" not in r.json()["usage"]


def test_constrained_text_is_the_librarys_constrained_decode(client, model):
  """Greedy, float32: NTP's, verified SBD's and plain SBD's text under a regex and a schema are
  the library's (`SamplerSettings.constraint`, the rows in one batch), token for token, with the
  same forced tokens and forwards."""
  constraints = [Constraint.regex("[a-z ]{2,9}"), Constraint.json_schema(LONG)]
  asks = [
    {"structured_outputs": {"regex": "[a-z ]{2,9}"}},
    {"response_format": _schema_format(LONG)},
  ]
  for decoding, verify in (("ntp", False), ("sbd", True), ("sbd", False)):
    s = RUN.replace(mode=decoding, verify=verify)
    prompts = [[BOS, *b"hi"]] * 2
    want = sampler.decode(model, prompts, s, tokenizer=TOKENIZER, constraints=constraints)
    for i, ask in enumerate(asks):
      r = complete(client, decoding=decoding, verify=verify, **ask)
      choice, usage = _choice(r), r.json()["usage"]
      tokens = [t for t in want.tokens[i] if t != EOS]
      assert choice["text"] == TOKENIZER.decode(tokens), (decoding, verify, i)
      assert usage["completion_tokens"] == len(tokens)
      assert usage["forced_tokens"] == want.forced_tokens[i], (decoding, verify, i)
      assert choice["structured_output"]["complete"] == bool(want.complete[i])
      if decoding == "sbd":
        assert usage["forwards"] == want.nfe[i], (decoding, verify, i)


def test_rows_with_different_constraints_and_none_share_one_batch(started, client, monkeypatch):
  """Two constrained requests and an unconstrained one, sent together: one device call of the
  SBD pool decodes the three rows, the two automata in its table set; no compilation happens."""
  app, engine = started
  before, pools = engine.compilations(), list(engine.pools)
  seen = []
  advance = pool_lib.Pool._advance

  def spy(self, *args, **kwargs):
    if self.tables is not None:
      seen.append([(h is not None, c) for h, c in zip(self.holder, self.tables.constraint_B)])
    return advance(self, *args, **kwargs)

  monkeypatch.setattr(pool_lib.Pool, "_advance", spy)
  # The engine waits until the three are queued, then takes them in one pass.
  passing, deadline, opened = engine._pass, time.monotonic() + 60, []

  def gated():
    queued = sum(len(p.waiting) for p in engine.pools.values())
    if not opened and queued < 3 and time.monotonic() < deadline:
      time.sleep(0.002)
      return True
    opened.append(True)
    return passing()

  monkeypatch.setattr(engine, "_pass", gated)
  bodies = [
    {"structured_outputs": {"regex": "[d-f]{4}"}},
    {"response_format": _schema_format({"type": "array", "items": {"type": "integer"}})},
    {},
  ]
  with concurrent.futures.ThreadPoolExecutor(3) as threads:
    replies = list(threads.map(lambda b: complete(client, **b), bodies))
  texts = [_choice(r)["text"] for r in replies]
  assert re.fullmatch("[d-f]{4}", texts[0])
  assert re.fullmatch(r"\[(-?[0-9]+(,-?[0-9]+)*)?\]?|\[[-0-9,]*", texts[1]), texts[1]
  together = [
    row for row in seen
    if all(held for held, _ in row) and len({c for _, c in row if c is not None}) == 2
    and any(c is None for _, c in row)
  ]  # fmt: skip
  assert together, seen
  assert engine.compilations() == before and list(engine.pools) == pools


def test_bad_constraints_get_400_naming_the_field(client):
  """An invalid schema, an unsupported keyword or type, unknown keys, both fields, a constraint
  larger than the tables: OpenAI's error body, one line, the field named."""
  bad = [
    ({"response_format": {"type": "grammar"}}, "response_format", ["'grammar' is not supported"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format", ["json_schema.schema"]),
    ({"response_format": _schema_format({"type": "nonsense"})}, "response_format", []),
    ({"response_format": _schema_format({"type": "object", "patternProperties": {"a": {}}})},
     "response_format", ["patternProperties"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
     "response_format", ["unknown field 'extra'"]),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format", []),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", ["grammar"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", []),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", ["regex"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", ["choice"]),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", ["both"]),
    ({"structured_outputs": {"regex": "[a-z]{1500}"}}, "structured_outputs",
     ["too large for this server's tables", "--constraint_states"]),
  ]  # fmt: skip
  for body, param, fragments in bad:
    _refused(complete(client, **body), param, *fragments)
  chat = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "x"}}
  _refused(client.post("/v1/chat/completions", json=chat), "response_format", "'x'")


def test_a_schema_that_cannot_finish_ends_length_noted_incomplete(client):
  """Its shortest text is longer than max_tokens: "length", noted incomplete, its text a prefix
  of a valid one (never invalid JSON noted complete)."""
  for decoding in ("sbd", "ntp"):
    r = complete(client, response_format=_schema_format(LONG), decoding=decoding)
    choice = _choice(r)
    assert choice["finish_reason"] == "length" and choice["structured_output"] == {
      "complete": False
    }
    assert '{"a_long_property_name":'.startswith(choice["text"]), choice["text"]
    assert r.json()["usage"]["completion_tokens"] == MAX_NEW


def test_a_server_without_structured_output_refuses_constraints(started):
  """--nostructured_output: its pools are not constrained, and a constraint gets 400."""
  assert not protocol.pool_settings(RUN, LIMITS, "sbd", 4, RUN.rule).constrained
  assert protocol.pool_settings(RUN, STRUCTURED, "sbd", 4, RUN.rule).constrained
  with make_client(started[1]) as c:
    for body in (
      {"response_format": _schema_format(FLAG)},
      {"response_format": {"type": "json_object"}},
      {"structured_outputs": {"choice": ["a"]}},
    ):
      field = next(iter(body))
      _refused(complete(c, **body), field, "--nostructured_output")


def test_a_repack_moves_a_decoding_rows_automaton(started, model):
  """A row's constraint moves in the table set when a finished row's constraint is dropped
  for a new one (`pool_tables`): the row goes on decoding its own constraint, the library's
  text token for token."""
  from sbd_jax.decode import automata
  from sbd_jax.serving import requests as requests_lib

  engine = started[1]
  settings = protocol.pool_settings(RUN, STRUCTURED, "sbd", RUN.block_size, RUN.rule)
  vocab = automata.vocabulary(TOKENIZER, RUN, LIMITS.vocab_size)
  short, long_, new = (
    Constraint.choice(["ok"]), Constraint.regex("[g-k]{12}"), Constraint.regex("[l-n]{3}")
  )  # fmt: skip
  events = {c: [] for c in (short, long_, new)}
  done = {c: threading.Event() for c in events}

  def request(constraint, then=None):
    def emit(event):
      events[constraint].append(event)
      if isinstance(event, requests_lib.Finished):
        done[constraint].set()
        if then is not None:
          engine.submit(request(then))  # while the long row decodes

    automaton = automata.compiler().compile(constraint, vocab)
    return requests_lib.Request(
      [BOS, *b"hi"], settings, RUN.gamma, MAX_NEW, 0, emit, verify=True,
      constraint=constraint, automaton=automaton,
    )  # fmt: skip

  pool = engine.pools[settings]
  moved = pool.tables.moved_rows
  engine.submit(request(short, then=new), request(long_))
  assert all(d.wait(60) for d in done.values())
  assert pool.tables.moved_rows > moved  # the long row's automaton moved
  want = sampler.decode(
    model, [[BOS, *b"hi"]], RUN.replace(verify=True, constraint=long_), tokenizer=TOKENIZER
  )
  got = [t for e in events[long_] if isinstance(e, requests_lib.Tokens) for t in e]
  assert got == [t for t in want.tokens[0] if t != EOS]
  assert re.fullmatch("[g-k]{12}", TOKENIZER.decode(got))
  (finished,) = [e for e in events[long_] if isinstance(e, requests_lib.Finished)]
  assert finished.complete and finished.reason == "length"


def test_pool_tables_pack_live_constraints_and_hold_back_what_does_not_fit():
  """`PoolTables`: constraints packed in order; one that does not fit beside the live rows'
  waits (nothing changes), and fits once a row frees, the live row's states shifted; a
  waiting constraint holds back the constrained requests behind it, not unconstrained ones; one
  larger than the tables alone is refused in one line."""
  from types import SimpleNamespace

  from sbd_jax.constrain.spec import ConstraintError
  from sbd_jax.decode import automata
  from sbd_jax.serving.pool_tables import Capacity, PoolTables

  vocab = automata.vocabulary(TOKENIZER, RUN, LIMITS.vocab_size)
  made = {}
  for name, c in dict(
    a=Constraint.regex("[a-c]{3}"), b=Constraint.regex("[0-9]{5}"),
    c=Constraint.choice(["yes", "no"]), tiny=Constraint.regex("q"), big=Constraint.regex("x{20}"),
  ).items():  # fmt: skip
    made[name] = (c, automata.compiler().compile(c, vocab))
  states = {name: a.num_states for name, (_, a) in made.items()}
  assert (states["a"], states["b"], states["c"], states["tiny"]) == (4, 6, 5, 2)
  capacity = Capacity(16, 16)
  t = PoolTables(capacity, 3, LIMITS.vocab_size, RUN.mask_id, place=lambda tables: tables)
  assert t.ctables.allowed_AU.shape[0] == 16 and t.ctables.move_token_M.shape[0] == 16
  assert t.place_row(0, *made["a"]) == 2 and t.place_row(1, *made["b"]) == 6
  assert t.place_row(2, *made["c"]) is None and t.constraint_B[2] is None  # 2 + 4 + 6 + 5 > 16
  assert t.shift_B().tolist() == [0, 0, 0]
  t.free(0)
  assert t.place_row(2, *made["c"]) == 8  # a dropped: b first, then c
  assert t.shift_B().tolist() == [0, -4, 0] and t.shift_B().tolist() == [0, 0, 0]
  assert t.place_row(0, None, None) == 0
  ask = lambda name: SimpleNamespace(constraint=made[name][0], automaton=made[name][1])  # noqa: E731
  plain = SimpleNamespace(constraint=None, automaton=None)
  pool = SimpleNamespace(waiting=collections.deque([ask("a"), ask("tiny"), plain]), tables=t)
  assert pool_lib.Pool._next(pool, 0) == (plain, 0)  # tiny would fit, but waits behind a
  assert pool_lib.Pool._next(pool, 0) is None and len(pool.waiting) == 2
  with pytest.raises(ConstraintError, match="^the constraint is too large for this server's"):
    capacity.check(made["big"][1])


def test_a_constraint_compiling_does_not_stall_the_server(client, monkeypatch):
  """While a constraint compiles (held here), the event loop answers others: an unconstrained
  request and a cached constraint's; then the held one is answered."""
  from sbd_jax.constrain.compiler import ConstraintCompiler

  release, submitted = threading.Event(), threading.Event()
  submit = ConstraintCompiler.submit

  def held(self, constraint, vocabulary):
    future = concurrent.futures.Future()

    def later():
      submitted.set()
      release.wait(60)
      try:
        future.set_result(submit(self, constraint, vocabulary).result())
      except Exception as e:
        future.set_exception(e)

    threading.Thread(target=later, daemon=True).start()
    return future

  _choice(complete(client, response_format=_schema_format(FLAG)))  # compiled, then cached
  monkeypatch.setattr(ConstraintCompiler, "submit", held)
  with concurrent.futures.ThreadPoolExecutor(1) as thread:
    slow = thread.submit(complete, client, structured_outputs={"regex": "[p-r]{2}z"})
    assert submitted.wait(60)
    assert _choice(complete(client)) and not slow.done()
    choice = _choice(complete(client, response_format=_schema_format(FLAG)))
    jsonschema.validate(json.loads(choice["text"]), FLAG)
    assert not slow.done()
    release.set()
    assert re.fullmatch("[p-r]{2}z", _choice(slow.result(60))["text"])
