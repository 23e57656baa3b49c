"""Verified SBD: NTP's text token for token, its forwards and rollbacks against an uncached
reference, and the KV cache after a rollback against a causal forward of the kept text."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_helpers import (  # tests/ is on sys.path
  BOS,
  MASK,
  PAD,
  PROMPTS,
  decode_settings,
  peaky_model,
  reference_ntp,
  reference_verified,
)
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import loop, reveal, sampler, sampling
from sbd_jax.decode.policy import Tuning
from sbd_jax.decode.state import RowLayout, initial_state, prompt_keys, prompt_meta
from sbd_jax.evals import results
from sbd_jax.model.architectures import RopeScaling, tiny
from sbd_jax.model.kv_cache import KVCache
from sbd_jax.model.transformer import Transformer

MORE = PROMPTS + [[BOS, 5, 6, 7, 8], [BOS] + list(range(100, 110)), [BOS, 200]]


@pytest.fixture(scope="module")
def model():
  return peaky_model()


@pytest.fixture(scope="module")
def eos(model):
  """A token the model emits early for some prompts and not others: rows end apart."""
  return sampler.decode(model, PROMPTS, decode_settings(mode="ntp", max_new_tokens=4)).tokens[0][2]


def _random_model(shape: str) -> Transformer:
  """A float32 model with random weights, shaped as Llama-3 (llama3 RoPE scaling) or Qwen-3
  (QK-norm, head dim apart from width / heads, θ 1e6). Its predictions are nearly flat, so
  its drafts are rejected often: every verified decode rolls back."""
  common = dict(vocab_size=260, num_layers=2, embed_dim=48, mlp_dim=96, attention_impl="dense")
  if shape == "llama":
    cfg = tiny(
      **common,
      num_heads=4,
      num_kv_heads=2,
      head_dim=12,
      rope_scaling=RopeScaling(original_max_position=32),
    )
  else:
    cfg = tiny(
      **common, num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=True, rope_theta=1e6
    ).replace(norm_eps=1e-6)
  return nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(3)))()


def _check_against_references(model, s, prompts, seed=0):
  """Tokens, reveal steps and NFE equal the uncached verified reference's, and the tokens NTP's
  (the uncached greedy reference, or with a temperature the sampler's NTP draws)."""
  out = sampler.decode(model, prompts, s, seed=seed)
  keys = prompt_keys(jnp.uint32(seed), jnp.arange(len(prompts)))
  rollbacks = 0
  for i, prompt in enumerate(prompts):
    tokens, steps, nfe, rolled = reference_verified(model, prompt, s, key=keys[i])
    assert (out.tokens[i], out.reveal_step[i], int(out.nfe[i])) == (tokens, steps, nfe), i
    assert MASK not in out.tokens[i]
    rollbacks += rolled
  if s.temperature == 0:
    assert out.tokens == [reference_ntp(model, p, s)[0] for p in prompts]
  else:
    ntp = sampler.decode(model, prompts, s.replace(mode="ntp"), seed=seed)
    assert out.tokens == ntp.tokens
  return out, rollbacks


# How verified rows draft and check: every forward checks, drafting as the rule picks or every
# position; and a block's draft checked by the next block's first forward.
POLICIES = {
  "rule": dict(draft="rule"),
  "all": dict(draft="all"),
  "per_block": dict(draft="rule", check_every_forward=False),
}


@pytest.mark.parametrize(
  "block_size, rule, gamma, max_new, policy",
  [
    pytest.param(4, "eb_entropy", 0.35, 13, "rule", marks=pytest.mark.integration),
    pytest.param(4, "eb_entropy", 3.0, 10, "rule", marks=pytest.mark.integration),
    (3, "eb_confidence", 0.5, 10, "rule"),  # k does not divide max_new_tokens
    pytest.param(8, "factor", 3.0, 16, "rule", marks=pytest.mark.integration),
    pytest.param(8, "threshold", 0.5, 13, "rule", marks=pytest.mark.integration),
    pytest.param(5, "confidence_threshold", 0.6, 9, "rule", marks=pytest.mark.integration),
    pytest.param(  # max_new_tokens shorter than one block
      16, "eb_entropy", 1.0, 12, "rule", marks=pytest.mark.integration
    ),
    pytest.param(4, "eb_entropy", 0.35, 13, "all", marks=pytest.mark.integration),
    (8, "threshold", 0.5, 16, "all"),
    pytest.param(16, "eb_entropy", 1.0, 12, "all", marks=pytest.mark.integration),
    (4, "eb_entropy", 0.35, 13, "per_block"),
    pytest.param(3, "eb_confidence", 0.5, 10, "per_block", marks=pytest.mark.integration),
    pytest.param(8, "threshold", 0.5, 13, "per_block", marks=pytest.mark.integration),
  ],
)
def test_verified_is_ntp_and_equals_the_uncached_reference(
  model, eos, block_size, rule, gamma, max_new, policy
):
  """Every rule, block size, γ and policy, six rows moving alone, rows ending at their EOS or
  limit (no pauses: every forward is wide, as in the reference)."""
  s = decode_settings(
    block_size=block_size, rule=rule, gamma=gamma, max_new_tokens=max_new, verify=True
  ).replace(eos_id=eos, adaptive=False, **POLICIES[policy])
  out, rollbacks = _check_against_references(model, s, MORE)
  assert 0 < sum(out.finished) < len(MORE)  # some rows end at an EOS, some at the limit
  assert rollbacks > 0  # the peaky model's drafts disagree with NTP somewhere


@pytest.mark.parametrize("temperature, seed", [(0.7, 0), (2.0, 5)])
def test_seeded_sampling_is_ntps_sample(model, eos, temperature, seed):
  """NTP draws slot r with Gumbel noise fixed by (the row's key, r); the drafter draws r with the
  same noise, and a draft is kept where it equals NTP's draw: the same seed gives NTP's
  sampled text, token for token."""
  s = decode_settings(block_size=4, gamma=0.35, max_new_tokens=13, temperature=temperature)
  s = s.replace(eos_id=eos, verify=True, adaptive=False)
  _check_against_references(model, s, MORE, seed=seed)


@pytest.mark.parametrize(
  "shape, layouts",
  [
    pytest.param("llama", ((1, False), (4, False), (2, True)), marks=pytest.mark.integration),
    pytest.param("qwen", ((4, False),), marks=pytest.mark.integration),
  ],
)
def test_random_models_batches_and_the_refill_queue(shape, layouts):
  """Random Llama- and Qwen-shaped models (most greedy drafts rejected): verified decodes
  equal NTP's, and the uncached reference's forwards, alone, in batches of 4 and through 2 rows
  refilled with the next prompt; seeded sampling equals NTP's sample."""
  model = _random_model(shape)
  s = decode_settings(block_size=4, gamma=1.0, max_new_tokens=11, verify=True, adaptive=False)
  ntp = [reference_ntp(model, p, s)[0] for p in MORE]
  expected = [reference_verified(model, p, s) for p in MORE]
  assert [e[0] for e in expected] == ntp
  assert sum(e[3] for e in expected) > len(MORE)  # rollbacks
  for rows, refill in layouts:
    out = sampler.decode(model, MORE, s.replace(refill=refill), batch_size=rows)
    assert out.tokens == ntp, (rows, refill)
    assert out.reveal_step == [e[1] for e in expected]
    assert list(out.nfe) == [e[2] for e in expected]
  sampled = s.replace(temperature=1.0, rule="threshold")
  out = sampler.decode(model, MORE, sampled, seed=7, batch_size=4)
  assert out.tokens == sampler.decode(model, MORE, sampled.replace(mode="ntp"), seed=7).tokens


def test_block_size_1_is_ntp_at_one_token_per_forward(model, eos):
  """With one-token blocks each forward's causal half gives NTP's next token, set at the
  block at once: NTP's tokens and forwards exactly."""
  s = decode_settings(block_size=1, max_new_tokens=10, verify=True).replace(eos_id=eos)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp"))
  out = sampler.decode(model, MORE, s)
  assert out.tokens == ntp.tokens
  np.testing.assert_array_equal(out.nfe, ntp.nfe)


@functools.partial(jax.jit, static_argnames=("graphdef", "s", "cache_length"))
def _decode_for(graphdef, state, prompt_BQ, prompt_len_B, forwards, cost_K, *, s, cache_length):
  """The verified decode's state after `forwards` forwards (the prefill's included), its
  forwards chosen at the costs `cost_K` (`policy.Tuning`)."""
  b = prompt_BQ.shape[0]
  cfg = nnx.merge(graphdef, state).cfg
  cache, keys = KVCache.empty(cfg, b, cache_length), prompt_keys(0, jnp.arange(b))
  st = initial_state(
    s, cache, keys, jnp.zeros(b, bool), True, tuning=Tuning.of(cost_K, block_size=s.block_size)
  )
  rows = RowLayout.of(prompt_len_B, s.response_slots)
  forward = functools.partial(loop.model_forward, graphdef, state, mesh=None)
  active_B, gamma = jnp.ones((b,), bool), jnp.float32(s.gamma)
  st = loop.prefill(st, prompt_BQ, rows, forward, s, gamma, active_B, True)
  go = lambda st: (st.forwards < forwards) & ~jnp.all(st.done_B)
  return loop.decode_while(st, rows, forward, s, gamma, active_B, True, go)


@functools.partial(jax.jit, static_argnames="graphdef")
def _causal_cache(graphdef, state, tokens_1S, seg_1S, pos_1S):
  model = nnx.merge(graphdef, state)
  empty = KVCache.empty(model.cfg, 1, tokens_1S.shape[1])
  return model.features(tokens_1S, TokenMeta.causal(seg_1S, pos_1S), empty)[1]


@pytest.mark.integration
@pytest.mark.parametrize("cost_K", [(1.0, 1.0, 1.0), (1.0, 1.3, 2.8)])
def test_a_rollback_leaves_the_cache_as_a_causal_forward_of_the_kept_text(model, eos, cost_K):
  """After every forward of a decode with rollbacks, each row's cache holds in its committed
  slots (through the cache's end) exactly what one causal forward of the prompt and the
  committed tokens writes there: keys, values, positions and segments; nothing of a rejected
  draft, and no block token, is left there. Every forward of the block's width, or chosen among
  NTP's forwards and narrow and wide ones (runs cut to a narrow forward's width)."""
  s = decode_settings(block_size=4, gamma=1.0, max_new_tokens=13, verify=True)
  s = s.replace(eos_id=eos, draft="rule")
  prompts = MORE[:4]
  q = sampler.prompt_bucket(max(len(p) for p in prompts))
  prompt_BQ = np.full((len(prompts), q), PAD, np.int32)
  for i, p in enumerate(prompts):
    prompt_BQ[i, q - len(p) :] = p
  prompt_len_B = np.asarray([len(p) for p in prompts], np.int32)
  length = s.cache_slots(q, len(prompts))
  graphdef, state = nnx.split(model)
  rolled_back, kinds = 0, np.zeros(len(cost_K), bool)
  for forwards in range(1, 30):
    st = _decode_for(
      graphdef, state, prompt_BQ, prompt_len_B, forwards, jnp.asarray(cost_K), s=s,
      cache_length=length,
    )  # fmt: skip
    kinds = np.maximum(kinds, np.asarray(st.kind_forwards_K) > 0)
    rolled_back = max(rolled_back, int(st.rollbacks_B.sum()))
    for b, prompt in enumerate(prompts):
      commit, end = int(st.commit_B[b]), int(st.cache.end[b])
      assert end == q + commit
      text = prompt + [int(t) for t in st.tokens_BR[b, :commit]]
      assert MASK not in text
      # The causal forward writes slots [0, end) of a cache as long: the text ends at `end`.
      tokens = np.full((1, length), PAD, np.int32)
      tokens[0, end - len(text) : end] = text
      seg, pos = prompt_meta(jnp.asarray([len(text)]), end)
      seg = jnp.pad(seg, ((0, 0), (0, length - end)))
      pos = jnp.pad(pos, ((0, 0), (0, length - end)))
      want = _causal_cache(graphdef, state, tokens, seg, pos)
      kept = slice(end - len(text), end)
      for got_k, want_k, got_v, want_v in zip(st.cache.k, want.k, st.cache.v, want.v):
        np.testing.assert_allclose(got_k[b, kept], want_k[0, kept], atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(got_v[b, kept], want_v[0, kept], atol=2e-5, rtol=1e-5)
      np.testing.assert_array_equal(st.cache.meta.positions[b, kept], want.meta.positions[0, kept])
      np.testing.assert_array_equal(
        st.cache.meta.segment_ids[b, :end], want.meta.segment_ids[0, :end]
      )
      assert not st.cache.meta.is_block[b, :end].any()
    if bool(st.done_B.all()):
      break
  assert rolled_back > 0
  # Where the kinds cost apart, NTP's and narrow forwards ran (these drafts fail: never the
  # widest); at one cost, never the narrow one (NTP's forward only where one token is left to a
  # row: nothing to draft).
  assert (kinds[0] and kinds[1]) if cost_K[1] > 1 else (kinds[2] and not kinds[1])


def test_verify_needs_rows_that_move_alone():
  with pytest.raises(ValueError, match="verify rolls rows back alone") as info:
    decode_settings(verify=True, lockstep=True)
  assert "\n" not in str(info.value)


def test_results_name_verified_decodings():
  verified = decode_settings(rule="eb_entropy", gamma=0.35, verify=True)
  assert verified.label == "sbd verified"  # drafting every masked position: no rule, no γ
  by_rule = verified.replace(draft="rule")
  assert by_rule.label == "sbd eb_entropy γ=0.35 verified"
  assert by_rule.replace(check_every_forward=False).label == by_rule.label + " checked per block"
  assert verified.replace(verify=False, rule="threshold", gamma=0.1).label == "sbd threshold γ=0.1"
  assert verified.replace(mode="ntp").label == results.NTP


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(draft="some"), "unknown draft 'some'"),
    (dict(wide_cost=0.5), r"wide_cost must be 0 \(measured\) or >= 1"),
    (dict(adaptive="yes"), "adaptive must be True or False"),
    (dict(check_every_forward=None), "check_every_forward must be True or False"),
  ],
)
def test_bad_verification_settings(change, message):
  with pytest.raises(ValueError, match=message) as info:
    decode_settings(verify=True, **change)
  assert "\n" not in str(info.value)


def _draft_the_least_likely_token(monkeypatch):
  """Drafts as a drafter that is nearly always wrong would make them: every draft is the token
  its block position ranks least likely, which NTP (the causal logits' argmax, or a sample of
  them) seldom chooses. Programs compiled before are dropped, and again after the test."""

  def least_likely(logits_BPV, st, slot_BP, s):
    tokens_BP, logp_BPV = sampling.pick_rows(logits_BPV, st, slot_BP, s)
    worst_BP = jnp.argmin(jnp.where(logp_BPV == -jnp.inf, jnp.inf, logp_BPV), axis=-1)
    return worst_BP.astype(tokens_BP.dtype), logp_BPV

  monkeypatch.setattr(reveal, "pick_rows", least_likely)
  jax.clear_caches()


@pytest.fixture
def wrong_drafts(monkeypatch):
  _draft_the_least_likely_token(monkeypatch)
  yield
  monkeypatch.undo()
  jax.clear_caches()


@pytest.mark.parametrize(
  "block_size, draft, temperature",
  [
    pytest.param(4, "rule", 0.0, marks=pytest.mark.integration),
    pytest.param(8, "all", 0.0, marks=pytest.mark.integration),
    pytest.param(4, "all", 1.0, marks=pytest.mark.integration),
  ],
)
def test_a_verified_answer_never_costs_more_forwards_than_ntps(
  model, eos, wrong_drafts, block_size, draft, temperature
):
  """With drafts that are nearly always wrong, every forward still settles a token of NTP's (a
  correction, or NTP's token at the block's first masked slot): each answer costs at most
  NTP's forwards, alone, in a batch and refilled. Checked per block instead, a block drafted a
  token per forward costs its forwards and settles two tokens."""
  s = decode_settings(block_size=block_size, gamma=1.0, max_new_tokens=16, verify=True)
  s = s.replace(eos_id=eos, draft=draft, temperature=temperature, adaptive=False)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp"), seed=3)
  for rows, refill in ((None, False), (4, False), (2, True)):
    out = sampler.decode(model, MORE, s.replace(refill=refill), seed=3, batch_size=rows)
    assert out.tokens == ntp.tokens
    assert 20 * out.accepted_tokens.sum() < out.draft_tokens.sum()  # nearly always wrong
    assert (out.nfe <= ntp.nfe).all(), (rows, refill, out.nfe, ntp.nfe)
  by_block = s.replace(check_every_forward=False, draft="rule", gamma=0.0)  # a token a forward
  per_block = sampler.decode(model, MORE, by_block, seed=3)
  assert per_block.tokens == ntp.tokens
  assert (per_block.nfe > ntp.nfe + 1).any()


@pytest.mark.integration
def test_rows_whose_drafts_fail_run_ntp_forwards(model, eos, wrong_drafts):
  """Adaptive, where a wide forward costs more than a one-token one: rows whose drafts keep
  failing run NTP's one-token forwards, with a few probes; every kind costing the same
  (`wide_cost=1`), every forward stays wide. NTP's text and NTP's forwards throughout."""
  s = decode_settings(block_size=4, max_new_tokens=64, verify=True).replace(eos_id=-1)
  ntp = sampler.decode(model, MORE[:2], s.replace(mode="ntp"))
  dear = sampler.decode(model, MORE[:2], s.replace(wide_cost=2.5))
  same = sampler.decode(model, MORE[:2], s.replace(wide_cost=1.0))
  assert dear.tokens == same.tokens == ntp.tokens
  assert (dear.nfe == ntp.nfe).all() and (same.nfe == ntp.nfe).all()  # one token per forward
  # Every forward wide, but where one token is left (nothing to draft for: NTP's forward).
  assert same.wide_forwards == same.forwards - same.prefills - same.ntp_forwards
  assert same.ntp_forwards <= len(MORE[:2])
  assert dear.wide_forwards <= 6, dear.batch_kind_forwards  # probes at 4, 12, 28, 60
  assert dear.drafts.sum() >= 2  # the probes' first tokens were checked by NTP's forwards


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_drafts_is_ntp_at_the_verified_decodes_shapes(model, eos, temperature):
  """draft="none": each forward is the verified decode's wide forward with nothing drafted,
  settling NTP's one token: NTP's text and NTP's forwards exactly, against the reference."""
  s = decode_settings(block_size=4, max_new_tokens=13, verify=True, temperature=temperature)
  s = s.replace(eos_id=eos, draft="none", adaptive=False)
  out, _ = _check_against_references(model, s, MORE, seed=2)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp"), seed=2)
  np.testing.assert_array_equal(out.nfe, ntp.nfe)
  assert out.draft_tokens.sum() == 0 and out.wide_forwards == out.forwards - out.prefills


@pytest.mark.integration
def test_in_bfloat16_verified_equals_ntp_at_its_own_forward_shapes():
  """bfloat16 rounds a 2P-token forward differently from a one-token one, so near-ties can flip
  between verified decoding and NTP's one-token decode (`benchmarks.precision` measures how
  often on trained models); verified without pauses computes each check in the forward, and at
  the query position, that NTP decoded at the verified decode's shapes (draft="none") uses, so
  the two are equal token for token."""
  model = peaky_model(dtype="bfloat16")
  s = decode_settings(block_size=4, max_new_tokens=12, verify=True, adaptive=False)
  verified = sampler.decode(model, MORE, s)
  at_its_shapes = sampler.decode(model, MORE, s.replace(draft="none"))
  assert verified.tokens == at_its_shapes.tokens
  assert verified.accepted_tokens.sum() > 0  # drafts were checked, not only NTP's tokens


def test_rows_whose_checks_accept_long_runs_draft_only_what_they_are_sure_of():
  """Adaptive, drafting the whole block: a row whose checks accepted more than half a block on
  average drafts only its first open position and those predicted with probability above
  `policy.SURE`; one whose checks accept short runs (or that has none yet) drafts every one."""
  from sbd_jax.decode import policy
  from sbd_jax.decode.acceptance import Acceptance

  p = 4
  st = initial_state(
    decode_settings(block_size=p, verify=True), KVCache.empty(peaky_model().cfg, 3, 8),
    prompt_keys(0, jnp.arange(3)), jnp.zeros(3, bool), True,
  )  # fmt: skip
  # Rows: 5 accepted in 2 checks (2.5 > p / 2), 4 in 2 (= p / 2: not more), none yet.
  counts = Acceptance.zeros(3, p)
  st = st.replace(
    acceptance=counts.replace(drafts_B=jnp.array([2, 2, 0]), accepted_B=jnp.array([5, 4, 0]))
  )
  sure = jnp.log(jnp.array([0.95, 0.02, 0.02, 0.01]))  # one token at 0.95
  unsure = jnp.log(jnp.array([0.6, 0.2, 0.1, 0.1]))
  logp_BPV = jnp.broadcast_to(jnp.stack([sure, unsure, unsure, sure]), (3, p, 4))
  open_BP = jnp.ones((3, p), bool)
  got = np.asarray(policy.sure_enough(st, logp_BPV, open_BP))
  np.testing.assert_array_equal(got, [[1, 0, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1]])
  # The first open position is drafted however unsure; closed ones never.
  open_BP = jnp.array([[0, 1, 1, 1]] * 3, bool)
  got = np.asarray(policy.sure_enough(st, logp_BPV, open_BP))
  np.testing.assert_array_equal(got, [[0, 1, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1]])
