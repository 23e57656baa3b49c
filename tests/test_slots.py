"""The server's rows on device (`serving.slots`): rows admitted one at a time and advanced
together decode each prompt as `sampler.decode` does alone; the tokens a row reports settled
never change afterwards (verified rows: only NTP's); a row's limit never exceeds its slots."""

import numpy as np
import pytest
from decode_helpers import (  # tests/ is on sys.path
  BOS,
  MASK,
  PROMPTS,
  decode_settings,
  peaky_model,
  recompute,
)

from sbd_jax.decode import sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.state import default_tuning
from sbd_jax.serving import slots

ROWS, BUCKET = 4, 32
PROMPTS4 = PROMPTS + [[BOS, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def model():
  return sampler.SamplingModel.of(peaky_model())


def _serve(sm, s, limits, temperatures=None, verify=None):
  """Admit PROMPTS4 with `limits` (and, given, each row's temperature, in one sampled pool, and
  whether each row verifies), advance until every row is done; returns the final view and every
  view's settled tokens per row."""
  if temperatures is not None:
    s = s.replace(temperature=settings_lib.TRACED_TEMPERATURE)
  temperatures = temperatures or [s.temperature] * ROWS
  verify = verify or [s.verify] * ROWS
  static = dict(
    settings=s.with_traced_values(),
    model_cfg=sm.cfg,
    cache_length=s.cache_slots(BUCKET, ROWS),
    mesh=None,
  )
  st = slots.init(rows=ROWS, **static)
  for row, (prompt, limit, t, v) in enumerate(zip(PROMPTS4, limits, temperatures, verify)):
    prompt_1Q = np.full((1, BUCKET), s.pad_id, np.int32)
    prompt_1Q[0, BUCKET - len(prompt) :] = prompt
    st = slots.admit(
      sm.static_graph, sm.weights, st, np.int32(row), prompt_1Q,
      np.array([len(prompt)], np.int32), np.uint32(0), np.int32(row), np.int32(limit),
      np.float32(s.gamma), np.float32(t), np.bool_(v), **static,
    )  # fmt: skip
  history = []
  for _ in range(200):
    st, view_BX = slots.advance(
      sm.static_graph, sm.weights, st, np.zeros(ROWS, bool), np.bool_(False), default_tuning(s),
      forwards=3, **static,
    )  # fmt: skip
    view = slots.unpack(np.asarray(view_BX), s.response_slots)
    history.append([list(view.tokens_BR[b, : view.settled_B[b]]) for b in range(ROWS)])
    if view.done_B.all():
      return view, history
  raise AssertionError("the rows did not finish")


@pytest.mark.parametrize("verify", [False, pytest.param(True, marks=pytest.mark.integration)])
def test_rows_decode_as_alone_and_settled_tokens_never_change(model, verify):
  s = decode_settings(block_size=4, gamma=1.0, max_new_tokens=10, verify=verify, refill=True)
  s = s.replace(adaptive=False)  # with pauses a row's forwards depend on its batch (its text not)
  view, history = _serve(model, s, [s.max_new_tokens] * ROWS)
  for b, prompt in enumerate(PROMPTS4):
    alone = sampler.decode(model, [prompt], s.replace(refill=False))
    assert history[-1][b] == alone.tokens[0], b
    assert view.nfe_B[b] == alone.nfe[0]
    for earlier, later in zip(history, history[1:]):  # settled tokens are a growing prefix
      assert later[b][: len(earlier[b])] == earlier[b]
  if verify:  # what a verified row reports settled is NTP's, at every call
    ntp = sampler.decode(model, PROMPTS4, s.replace(mode="ntp", verify=False, refill=False))
    for views in history:
      for b in range(ROWS):
        assert views[b] == ntp.tokens[b][: len(views[b])]


@pytest.mark.integration
def test_a_limit_past_the_rows_slots_is_clamped_to_them(model):
  """A caller asking for more tokens than the settings' max_new_tokens gets max_new_tokens,
  never a row that writes past its response slots."""
  s = decode_settings(block_size=4, gamma=1.0, max_new_tokens=10, verify=True, refill=True)
  view, _ = _serve(model, s, [10**6, 3, 10**6, 10])
  lengths = [len(t) for t in (view.tokens_BR[b, : view.settled_B[b]] for b in range(ROWS))]
  assert max(lengths) <= s.max_new_tokens and lengths[1] <= 3
  alone = sampler.decode(model, [PROMPTS4[0]], s.replace(refill=False))
  assert lengths[0] == len(alone.tokens[0])


@pytest.mark.parametrize(
  "mode, verify",
  [
    ("ntp", False),
    pytest.param("sbd", False, marks=pytest.mark.integration),
    pytest.param("sbd", True, marks=pytest.mark.integration),
  ],
)
def test_rows_at_their_own_temperatures_share_one_pool(model, mode, verify):
  """Greedy and sampled rows, each at its own temperature, in one sampled pool: every row
  decodes as `sample` decodes its prompt alone at that temperature (its key: seed 0, its
  index), so the temperature is a row's setting, not a compiled one."""
  temperatures = [0.0, 0.8, 0.0, 2.0]
  s = decode_settings(mode=mode, block_size=4, gamma=0.5, max_new_tokens=10, verify=verify)
  s = s.replace(refill=True)
  view, history = _serve(model, s, [s.max_new_tokens] * ROWS, temperatures)
  for b, (prompt, t) in enumerate(zip(PROMPTS4, temperatures)):
    alone = sampler.decode(
      model, [[BOS]] * b + [prompt], s.replace(refill=False, temperature=t), seed=0,
      batch_size=ROWS,
    )  # fmt: skip
    assert history[-1][b] == alone.tokens[b], (b, t)
    assert view.nfe_B[b] == alone.nfe[b]
  # The sampled rows did sample: another temperature gives another text somewhere.
  hot = _serve(model, s, [s.max_new_tokens] * ROWS, [5.0] * ROWS)[1][-1]
  assert hot != history[-1]


@pytest.mark.parametrize(
  "temperatures",
  [pytest.param([0.0] * ROWS, marks=pytest.mark.integration), [0.8, 0.0, 1.5, 0.7]],
)
def test_plain_and_verified_rows_share_one_pool(model, temperatures):
  """Rows that verify and rows that do not, in one program that can verify: a verified row
  decodes as verified `sample` alone (NTP's text, its rollbacks), a plain row as plain `sample`
  alone, token for token and forward for forward, greedy and sampled. So verification is a row's
  setting, and the program's extra work for it changes nothing in the other rows."""
  verify = [True, False, False, True]
  s = decode_settings(block_size=4, gamma=0.7, max_new_tokens=12, verify=True, refill=True)
  # Pauses (`adaptive`) make NTP's one-token forwards a batch's choice: off, a row's forwards
  # are its own whatever its neighbours do (with them, only its text is).
  s = s.replace(adaptive=False, draft="rule")
  view, history = _serve(model, s, [s.max_new_tokens] * ROWS, temperatures, verify)
  rollbacks = []
  for b, (prompt, t, v) in enumerate(zip(PROMPTS4, temperatures, verify)):
    alone = sampler.decode(
      model, [[BOS]] * b + [prompt], s.replace(refill=False, temperature=t, verify=v), seed=0,
      batch_size=ROWS,
    )  # fmt: skip
    assert history[-1][b] == alone.tokens[b], (b, t, v)
    assert view.nfe_B[b] == alone.nfe[b], (b, t, v)
    assert view.rollbacks_B[b] == (alone.rollbacks[b] if v else 0), (b, t, v)
    assert view.acceptance.draft_tokens_B[b] == (alone.draft_tokens[b] if v else 0), (b, t, v)
    assert view.acceptance.accepted_B[b] == (alone.accepted_tokens[b] if v else 0), (b, t, v)
    rollbacks.append(int(view.rollbacks_B[b]))
  # The verified rows' texts are NTP's; some draft was rolled back, so the check did work.
  s_ntp = s.replace(mode="ntp", verify=False, refill=False)
  for b in (0, 3):
    ntp = sampler.decode(
      model, [[BOS]] * b + [PROMPTS4[b]], s_ntp.replace(temperature=temperatures[b]), seed=0,
      batch_size=ROWS,
    )  # fmt: skip
    assert history[-1][b] == ntp.tokens[b], b
  assert sum(rollbacks) > 0


@pytest.mark.parametrize(
  "mode, verify, temperature",
  [
    ("sbd", True, 0.0),
    pytest.param("ntp", False, 0.8, marks=pytest.mark.integration),
    pytest.param("ntp", False, 0.0, marks=pytest.mark.integration),
  ],
)
def test_each_tokens_logprob_is_ntps_from_an_uncached_forward(model, mode, verify, temperature):
  """A row reports each settled token's log-probability: under NTP and verified SBD (NTP's text),
  that of an uncached causal forward over the prompt and the tokens before it, mask token
  excluded, at the row's temperature."""
  s = decode_settings(mode=mode, block_size=4, gamma=0.5, max_new_tokens=10, verify=verify)
  s = s.replace(refill=True, logprobs=True)
  view, _ = _serve(model, s, [s.max_new_tokens] * ROWS, [temperature] * ROWS)
  if not verify:  # the same tokens as a decode that keeps no log-probabilities
    plain = _serve(
      model, s.replace(logprobs=False), [s.max_new_tokens] * ROWS, [temperature] * ROWS
    )
    assert (plain[0].tokens_BR == view.tokens_BR).all() and not plain[0].logprob_BR.any()
  net = peaky_model()  # the `model` fixture's weights
  for b, prompt in enumerate(PROMPTS4):
    n = int(view.settled_B[b])
    tokens = [int(t) for t in view.tokens_BR[b, :n]]
    logits = recompute(net, prompt + tokens, num_clean=len(prompt) + n)[0]
    logits = np.array(logits, np.float32)[len(prompt) - 1 : len(prompt) - 1 + n]
    logits[:, MASK] = -np.inf
    scaled = logits / (temperature or 1.0)
    want = scaled[np.arange(n), tokens] - np.logaddexp.reduce(scaled, axis=-1)
    np.testing.assert_allclose(view.logprob_BR[b, :n], want, rtol=1e-4, atol=1e-4)
