"""Verified decoding's choice of forwards (`decode.policy`) and what forwards cost
(`decode.costs`): the estimates and the choice on constructed states, the costs recovered from
timed calls, and decodes whose drafts are accepted by construction, where the choice must keep
NTP's text and never cost more than NTP's forwards, or much more than NTP's time."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_helpers import (  # tests/ is on sys.path
  BOS,
  MASK,
  PROMPTS,
  decode_settings,
  peaky_model,
  reference_ntp,
  reference_verified,
)

from benchmarks.synthetic_acceptance import geometric, oracle_drafts
from sbd_jax.decode import acceptance_prior, costs, policy, reveal, sampler
from sbd_jax.decode.policy import Estimates, Tuning
from sbd_jax.decode.state import initial_state, prompt_keys
from sbd_jax.model.kv_cache import KVCache

MORE = PROMPTS + [[BOS, 5, 6, 7, 8], [BOS] + list(range(100, 110))]


@pytest.fixture(scope="module")
def model():
  return peaky_model()


def _powers(q, n: int):
  """[..., n]: q^0 .. q^(n-1), the moments of a known q (`policy.settled_per_forward`)."""
  return jnp.asarray(q, jnp.float32)[..., None] ** jnp.arange(n, dtype=jnp.float32)


def _mean(est, tuning):
  """[B]: each row's estimate of its λ, its belief's mean (`policy.belief`)."""
  shape_B, rate_B = policy.belief(est, tuning)
  return shape_B / rate_B


def test_expected_settled_counts_a_redraft_after_each_rejection_within_the_room_left():
  """Against a simulation of a row that runs wide forwards of width D: a check accepts a
  geometric run of its D - 1 drafts and settles one token more; after a rejection the next
  forward has nothing to check and settles one token. At most the room left."""
  rng = np.random.default_rng(0)
  q_B = jnp.asarray([0.0, 0.5, 0.9, 0.999])
  room_B = jnp.asarray([100, 100, 3, 100])
  got = np.asarray(policy.expected_settled(_powers(q_B, 16), (2, 4, 16), room_B))
  for b, q in enumerate(np.asarray(q_B, np.float64)):
    for w, d in enumerate((2, 4, 16)):
      forwards = 20_000
      right_FD = rng.random((forwards, d - 1)) < q
      run_F = np.where(right_FD.all(axis=1), d - 1, np.argmin(right_FD, axis=1))
      settled, pending = 0, False
      for run in run_F:
        settled += run + 1 if pending else 1
        pending = run == d - 1 if pending else True
      want = min(settled / forwards, int(room_B[b]))
      np.testing.assert_allclose(got[b, w], want, rtol=0.02, err_msg=f"q={q}, D={d}")


def test_survival_is_the_beliefs_expectation_of_accepting_each_run():
  """Against draws from numpy's Gamma: E[exp(-λ H_j)], H_j the prior's cumulative hazard over
  positions 1 .. j, acceptance falling with position. With E and a in expectation an uncertain
  λ is worth more than its mean alone (the long runs it may give); λ = 0 accepts every draft."""
  rng = np.random.default_rng(0)
  prior_P = np.asarray([1.0, 0.99, 0.98, 0.97, 0.95, 0.9, 0.8, 0.6], np.float32)
  hazard_P = -np.log(prior_P)
  np.testing.assert_allclose(policy.hazards(jnp.asarray(prior_P)), hazard_P, rtol=1e-5, atol=1e-7)
  for shape, rate in [(1.0, 1.0), (0.1, 0.1), (3.0, 9.0), (40.0, 2.0)]:
    got = np.asarray(policy.survival(jnp.float32(shape), jnp.float32(rate), hazard_P, 8))
    lam = rng.gamma(shape, 1 / rate, 400_000)
    want = [np.mean(np.exp(-lam * h)) for h in np.cumsum(hazard_P)]
    np.testing.assert_allclose(got, want, rtol=0.01, atol=1e-3, err_msg=f"{shape}, {rate}")
    expected = policy.settled_per_forward(jnp.asarray(got), (4, 8))
    plug_in = policy.settled_per_forward(np.exp(-shape / rate * np.cumsum(hazard_P)), (4, 8))
    assert (np.asarray(expected) >= np.asarray(plug_in) - 1e-5).all()
  sure = policy.survival(jnp.float32(0.0), jnp.float32(5.0), hazard_P, 8)
  np.testing.assert_allclose(policy.settled_per_forward(sure, (4, 8)), [4.0, 8.0], rtol=1e-6)


def test_a_rejection_early_in_a_row_does_not_stop_its_drafts_where_earlier_rows_accepted():
  """A learned prior of 0.99 weighs PRIOR_WEIGHT tokens: a row whose first check accepted 3
  drafts and then rejected one still goes wide at a block's cost of 2.9 (it expects 3.07 tokens
  a forward); at Laplace's weight the one rejection would send it to NTP's forwards (2.63)."""
  s = decode_settings(block_size=4, verify=True)
  tuning = Tuning.of((1.0, 1.9, 2.9), 0.99, learned=True, block_size=4)
  st = _state(1, s, [0.5], (1.0, 1.9, 2.9)).replace(tuning=tuning)
  st = st.replace(estimates=Estimates.fresh(1))
  checked = policy.observe(st, jnp.ones((1, 4), bool), jnp.asarray([[True, True, True, False]]))
  st = st.replace(
    estimates=checked,
    index=st.verified_B,  # nothing left to check: the next wide forward drafts again
  )
  assert int(policy.choose(st, jnp.ones(1, bool), s)) == 2
  unlearned = st.replace(tuning=tuning.replace(learned=jnp.asarray(False)))
  assert int(policy.choose(unlearned, jnp.ones(1, bool), s)) == policy.NTP


def test_a_run_of_wide_forwards_settles_what_the_policy_expects(model, monkeypatch, clear_after):
  """Every forward the block's, drafts right with probability q each (drawn afresh at every
  forward): tokens per forward are `expected_settled`'s, not the geometric run alone
  (1 + q + ... + q^(D-1)), 28-50 % more here: it leaves out the forward that drafts again
  after each rejection."""
  for d, q in [(4, 0.5), (8, 0.8)]:
    s = decode_settings(block_size=d, max_new_tokens=400, verify=True, adaptive=False)
    s = s.replace(eos_id=-1)
    ntp = sampler.decode(model, MORE, s.replace(mode="ntp"))
    _oracle_drafts(monkeypatch, ntp.tokens, geometric(q, seed=d), sure=True)
    out = sampler.decode(model, MORE, s)
    assert out.tokens == ntp.tokens
    per_forward = sum(map(len, out.tokens)) / out.nfe.sum()
    room = jnp.asarray([10**6])
    want = float(policy.expected_settled(_powers(jnp.asarray([q]), d), (d,), room)[0, 0])
    run_alone = sum(q**i for i in range(d))
    assert abs(per_forward / want - 1) < 0.04, (d, q, per_forward, want, run_alone)


def test_estimates_start_at_the_prior_and_follow_the_rows_own_checks():
  """A row's belief in its λ: the prior's, mean 1, as PRIOR_WEIGHT draft tokens at the mean
  hazard once learned (LAPLACE_WEIGHT at 1/2 before), then its own checks: each token tried
  adds its block position's hazard (half for a wrong one), each fading the earlier evidence by
  DECAY. A wide check's drafts start at position 1; NTP's one-token checks move one on."""
  s = decode_settings(block_size=4, verify=True)
  prior_P = np.asarray([1.0, 0.9, 0.8, 0.5], np.float32)
  h = -np.log(prior_P[1:])
  st = _state(3, s, [0.0] * 3, (1.0, 1.0, 1.0)).replace(estimates=Estimates.fresh(3))
  tuning = Tuning.of((1.0, 1.0, 1.0), prior_P, learned=True, block_size=4)
  shape, rate = policy.belief(st.estimates, tuning)
  np.testing.assert_allclose(shape, policy.PRIOR_WEIGHT * h.mean(), rtol=1e-5)
  np.testing.assert_allclose(rate, shape, rtol=1e-6)
  # Row 0: 3 drafted, all accepted; row 1: rejected at the first; row 2: checked nothing.
  drafted = jnp.asarray([[1, 1, 1], [1, 1, 1], [0, 0, 0]], bool)
  accepted = jnp.asarray([[1, 1, 1], [0, 0, 0], [0, 0, 0]], bool)
  st = st.replace(tuning=tuning)
  st = st.replace(estimates=policy.observe(st, drafted, accepted))
  np.testing.assert_allclose(st.estimates.exposure_B, [h.sum(), h[0] / 2, 0.0], rtol=1e-5)
  np.testing.assert_allclose(st.estimates.rejected_B, [0.0, 1.0, 0.0])
  for t, w in [
    (tuning, policy.PRIOR_WEIGHT),
    (tuning.replace(learned=False), policy.LAPLACE_WEIGHT),
  ]:
    a0 = w * h.mean()
    want = [a0 / (a0 + h.sum()), (a0 + 1) / (a0 + h[0] / 2), 1.0]
    np.testing.assert_allclose(_mean(st.estimates, t), want, rtol=1e-5)
  lam = np.asarray(_mean(st.estimates, tuning))
  # Evidence fades with every token tried: after tokens that are accepted, a rejection weighs
  # less.
  for _ in range(2):
    st = st.replace(estimates=policy.observe(st, drafted, jnp.ones((3, 3), bool)))
  assert float(_mean(st.estimates, tuning)[1]) < lam[1]
  np.testing.assert_allclose(st.estimates.rejected_B[1], policy.DECAY**6, rtol=1e-5)
  # NTP's one-token checks try the next draft of the block: positions 1, 2, then 3.
  one = st.replace(estimates=Estimates.fresh(3))
  accepted_one = jnp.ones((3, 1), bool)
  for position in (1, 2, 3):
    before = one.estimates.exposure_B[0]
    one = one.replace(estimates=policy.observe(one, accepted_one, accepted_one))
    added = one.estimates.exposure_B[0] - policy.DECAY * before
    np.testing.assert_allclose(added, -np.log(prior_P[position]), rtol=1e-5)
  assert (np.asarray(one.estimates.next_at_B) == 4).all()
  wide = policy.observe(one, jnp.zeros((3, 4), bool), jnp.zeros((3, 4), bool))
  assert (np.asarray(wide.next_at_B) == 1).all()


def _state(rows: int, s, q_B, cost_K, prior=0.5, force=-1):
  """A fresh decode state whose rows estimate acceptance `q_B` at every position (as if from
  many checks: λ = log q / log q0 at a prior of `prior` everywhere, on a million tokens)."""
  tuning = Tuning.of(cost_K, prior, force, block_size=s.block_size)
  st = initial_state(
    s, KVCache.empty(peaky_model().cfg, rows, 8), prompt_keys(0, jnp.arange(rows)),
    jnp.zeros(rows, bool), True, tuning=tuning,
  )  # fmt: skip
  lam_B = np.log(np.clip(np.asarray(q_B, np.float64), 1e-6, 1.0)) / np.log(prior)
  exposure = 1e6
  est = st.estimates.replace(
    exposure_B=jnp.full((rows,), exposure, jnp.float32),
    rejected_B=jnp.asarray(exposure * lam_B, jnp.float32),
  )
  # Each row's newest verified token at slot 0, a draft pending at slot 1.
  return st.replace(
    estimates=est,
    limit_B=jnp.full((rows,), 64, jnp.int32),
    verified_B=jnp.ones((rows,), jnp.int32),
    index=jnp.full((rows,), 2, jnp.int32),
  )


def test_the_batch_runs_the_kind_with_the_most_tokens_per_unit_of_cost():
  s = decode_settings(block_size=8, verify=True)
  assert s.draft_widths == (2, 4, 8)
  active = jnp.ones(4, bool)
  cheap = (1.0, 1.0, 1.0, 1.0)  # every kind costs the same: the widest settles the most
  assert int(policy.choose(_state(4, s, [0.9] * 4, cheap), active, s)) == 3
  cpu = (1.0, 1.4, 2.1, 4.0)  # growing with width, as on a compute-bound device
  # q = 0.9: R(2) = 1.82, R(4) = 2.92, R(8) = 4.09 tokens a forward (a rejection's redraft
  # counted); per cost 1.30, 1.39, 1.02: width 4.
  assert int(policy.choose(_state(4, s, [0.9] * 4, cpu), active, s)) == 2
  # q = 0.3: R(2) = 1.18 per 1.4 < 1: NTP.
  assert int(policy.choose(_state(4, s, [0.3] * 4, cpu), active, s)) == policy.NTP
  # One row with good drafts does not take three with bad ones wide (at best 5.35 tokens for
  # 1.6 against NTP's 4 for 1); four good rows go wide (11.7 tokens for 2.5).
  dear = (1.0, 1.6, 2.5, 4.0)
  mixed = [0.9, 0.3, 0.3, 0.3]
  assert int(policy.choose(_state(4, s, mixed, dear), active, s)) == policy.NTP
  assert int(policy.choose(_state(4, s, [0.9] * 4, dear), active, s)) == 2
  # Rows that are done do not count: the good row alone goes wide (2.92 tokens for 2.5).
  done = _state(4, s, mixed, dear).replace(done_B=jnp.asarray([False, True, True, True]))
  assert int(policy.choose(done, active, s)) == 2
  # A live row that does not verify makes the forward the whole block's; forcing overrides all.
  plain = _state(4, s, [0.3] * 4, cpu).replace(verify_B=jnp.asarray([True, True, True, False]))
  assert int(policy.choose(plain, active, s)) == 3
  assert int(policy.choose(_state(4, s, [0.9] * 4, cheap, force=0), active, s)) == policy.NTP


def test_near_a_tie_the_kind_running_now_stays():
  """Within STICK of the best kind's tokens per unit of cost, the kind running now stays;
  beyond it, and before any kind runs, the batch takes the best. q = 0.9, blocks of 4: a run of
  blocks settles 2.92 tokens a forward, so at a block's cost of 2.83 it is 3 % better than
  NTP's, at 3.0 3 % worse, at 2.55 14 % better and at 3.4 14 % worse."""
  s = decode_settings(block_size=4, verify=True)
  active = jnp.ones(4, bool)

  def chosen(block_cost, running):
    st = _state(4, s, [0.9] * 4, (1.0, 100.0, block_cost)).replace(kind=jnp.int32(running))
    return int(policy.choose(st, active, s))

  assert chosen(2.83, running=-1) == 2  # no kind chosen yet: the best
  assert chosen(2.83, running=policy.NTP) == policy.NTP
  assert chosen(3.0, running=2) == 2
  assert chosen(2.55, running=policy.NTP) == 2
  assert chosen(3.4, running=2) == policy.NTP


def test_a_row_with_nothing_to_check_probes_once_due_and_then_waits_twice_as_long():
  s = decode_settings(block_size=8, verify=True)
  active = jnp.ones(1, bool)
  cheap = (1.0, 1.05, 1.1, 1.2)  # an accelerator's: a probe costs 0.2 NTP forwards more
  st = _state(1, s, [0.0], cheap).replace(index=jnp.ones(1, jnp.int32))  # nothing pending
  assert int(policy.probe_floor(st.tuning, s.draft_widths)) < policy.FIRST_PROBE
  st = st.replace(nfe_B=jnp.full((1,), policy.FIRST_PROBE - 1, jnp.int32))
  assert int(policy.choose(st, active, s)) == policy.NTP  # not yet due
  st = st.replace(nfe_B=st.nfe_B + 1)
  kind = int(policy.choose(st, active, s))
  assert kind == 3  # due: the width that pays most if its drafts are all accepted (8 for 1.2)
  with_draft = st.replace(index=st.index + 1)  # a draft still to check: no probe
  assert int(policy.choose(with_draft, active, s)) == policy.NTP
  # Where no acceptance could make a wide forward pay, no probe.
  hopeless = st.replace(tuning=st.tuning.replace(cost_K=jnp.asarray([1.0, 2.5, 5.0, 9.0])))
  assert int(policy.choose(hopeless, active, s)) == policy.NTP
  est = policy.drafting(st, active, s)  # the probe runs: the gap doubles
  assert int(est.probe_gap_B[0]) == 2 * policy.FIRST_PROBE
  assert int(est.probe_at_B[0]) == int(st.nfe_B[0]) + 2 * policy.FIRST_PROBE
  good = est.replace(exposure_B=jnp.full(1, 1e3), rejected_B=jnp.zeros(1))
  good = st.replace(estimates=good)
  assert int(policy.drafting(good, active, s).probe_gap_B[0]) == policy.FIRST_PROBE
  # Where the probe costs 3 NTP forwards more (width 8 at 4.0, a CPU's), it comes after 30
  # forwards (3 / PROBE_SHARE), and the next after 30 more: a tenth of the time at most.
  cpu = st.replace(tuning=st.tuning.replace(cost_K=jnp.asarray([1.0, 1.4, 2.1, 4.0])))
  assert int(policy.probe_floor(cpu.tuning, s.draft_widths)) == 30
  assert int(policy.choose(cpu.replace(nfe_B=jnp.full((1,), 29)), active, s)) == policy.NTP
  cpu = cpu.replace(nfe_B=jnp.full((1,), 30))
  assert int(policy.choose(cpu, active, s)) == 3
  assert int(policy.drafting(cpu, active, s).probe_at_B[0]) == 60


def test_ntps_forwards_run_unchosen_until_a_draft_an_end_or_a_probe_could_change_the_choice():
  s = decode_settings(block_size=8, verify=True)
  active = jnp.ones(3, bool)
  cheap = (1.0, 1.05, 1.1, 1.2)  # an accelerator's: probes may come early
  st = _state(3, s, [0.3] * 3, cheap).replace(index=jnp.ones(3, jnp.int32))  # nothing pending
  est = st.estimates.replace(probe_at_B=jnp.asarray([9, 6, 4], jnp.int32))
  st = st.replace(estimates=est, nfe_B=jnp.asarray([2, 2, 4], jnp.int32), kind=jnp.int32(0))
  # Row 2's probe is due already (the choice knows it); row 1's falls due in 4 forwards.
  assert int(policy.unchanged_for(st, active, s)) == 4
  assert int(policy.unchanged_for(st.replace(kind=jnp.int32(2)), active, s)) == 0  # wide
  pending = st.replace(index=jnp.asarray([1, 1, 2]))  # a draft to check
  assert int(policy.unchanged_for(pending, active, s)) == 0
  plain = st.replace(verify_B=jnp.asarray([True, True, False]))
  assert int(policy.unchanged_for(plain, active, s)) == 0  # a live row that does not verify
  # Rows that are done, or not in the batch, wait for nothing; forced, nothing changes.
  assert int(policy.unchanged_for(st, jnp.asarray([True, False, True]), s)) == 7
  forced = st.replace(tuning=st.tuning.replace(force=jnp.int32(0)))
  assert int(policy.unchanged_for(forced, active, s)) > policy.MAX_PROBE_GAP
  # Where a probe costs 8 NTP forwards more (width 8 at 9), no row probes before 80 forwards.
  dear = st.replace(tuning=st.tuning.replace(cost_K=jnp.asarray([1.0, 2.5, 5.0, 9.0])))
  assert int(policy.probe_floor(dear.tuning, s.draft_widths)) == 80
  assert int(policy.unchanged_for(dear, active, s)) == 76


def test_the_prior_is_what_earlier_rows_accepted_by_position_and_follows_the_recent_ones():
  """Laplace's 1/2 with nothing seen; then at each block position what was accepted there,
  leaning on the rate over all positions as POSITION_WEIGHT tokens (a position no draft reached
  takes that rate)."""
  prior = acceptance_prior.Prior()
  assert prior.value == 0.5 and not prior.learned
  np.testing.assert_allclose(prior.by_position(4), [1.0, 0.5, 0.5, 0.5])
  prior.add(tried_P=[0, 30, 10], rejected_P=[0, 5, 5])
  v, w = 31 / 42, acceptance_prior.POSITION_WEIGHT
  assert prior.learned and prior.value == pytest.approx(v)
  want = [1.0, (25 + w * v) / (30 + w), (5 + w * v) / (10 + w), v, v]
  np.testing.assert_allclose(prior.by_position(5), want, rtol=1e-6)
  prior.add(
    tried_P=[0, acceptance_prior.PRIOR_HORIZON], rejected_P=[0, acceptance_prior.PRIOR_HORIZON]
  )
  assert prior.value < 0.02  # the old counts scaled down, the new ones dominate


def test_costs_are_recovered_from_timed_calls():
  """`measure` takes each kind's cost from calls of two lengths: a call's own cost and the
  prefill cancel, whatever the tokens a forward settles."""
  s = decode_settings(block_size=8, verify=True, max_new_tokens=64)
  per_forward = [2e-4, 3e-4, 5e-4, 9e-4]
  settles = [1, 2, 3, 5]
  calls = []

  def run(kind, limit):
    calls.append((kind, limit))
    forwards = 1 + -(-(limit - 1) // settles[kind])  # the prefill, then the rest
    return 0.05 + forwards * per_forward[kind], forwards

  table = costs.measure(run, s, rows=4)
  assert table.kinds == ("ntp", "2x2", "2x4", "2x8")
  np.testing.assert_allclose(table.seconds, per_forward, rtol=1e-9)
  np.testing.assert_allclose(table.cost_K, np.asarray(per_forward) / per_forward[0], rtol=1e-6)
  assert {limit for _, limit in calls} == {1, costs.TIMED_TOKENS}
  assert "2x8 0.9 ms (4.50x)" in table.describe()


def test_each_kind_is_timed_about_as_long_as_the_dearest():
  """After the first round the cheap kinds' calls are repeated, so the host's jitter in a call
  weighs alike on every kind; the costs are still recovered exactly."""
  s = decode_settings(block_size=8, verify=True, max_new_tokens=64)
  per_forward = [1e-4, 3e-4, 8e-4, 2e-3]
  calls = []

  def run(kind, limit):
    calls.append(kind)
    return 1e-3 + limit * per_forward[kind], limit

  table = costs.measure(run, s, rows=1)
  np.testing.assert_allclose(table.seconds, per_forward, rtol=1e-9)
  count_K = np.bincount(calls, minlength=4) // 2  # a short and a long call each time
  spent_K = count_K * (2e-3 + (1 + costs.TIMED_TOKENS) * np.asarray(per_forward))
  assert count_K[0] > 5 * count_K[3], count_K
  assert np.all(spent_K > 0.5 * spent_K[3]) and np.all(spent_K < 2 * spent_K[3]), spent_K


def test_a_timed_call_settles_one_token_a_forward_whatever_its_drafts(
  model, monkeypatch, clear_after
):
  """The program `costs.measure` times (`costs.forced`) rejects every draft, even drafts that
  are all NTP's own: every kind of forward settles one token, so a timed call's forwards are its
  tokens, and the text stays NTP's. The same drafts, not rejected, settle several a forward."""
  s = decode_settings(block_size=4, max_new_tokens=20, verify=True, gamma=1.0)
  s = s.replace(eos_id=-1, wide_cost=1.0)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp"))
  _oracle_drafts(monkeypatch, ntp.tokens, lambda slot_BP, st: slot_BP >= 0, sure=True)
  for kind in range(len(costs.kind_names(s))):
    timed = costs.forced(s, kind)
    for tuning in (timed, timed.replace(reject=np.bool_(False))):
      monkeypatch.setattr(sampler, "_tuning", lambda *a, tuning=tuning, **k: (tuning, None))
      out = sampler.decode(model, MORE, s)
      assert out.tokens == ntp.tokens
      assert (out.batch_kind_forwards[:, kind] == out.batch_kind_forwards.sum(axis=1)).all()
      if tuning is timed or kind == 0:
        assert (out.nfe == ntp.nfe).all(), (kind, out.nfe, ntp.nfe)
      else:
        assert (out.nfe < 0.7 * ntp.nfe).all(), (kind, out.nfe, ntp.nfe)


def test_a_table_is_measured_once_per_program_and_kept_beside_the_compilation_cache(
  tmp_path, monkeypatch
):
  s = decode_settings(block_size=4, verify=True, max_new_tokens=16)
  monkeypatch.setattr(costs, "_TABLES", {})
  monkeypatch.setattr(costs, "cache_directory", lambda: str(tmp_path))
  calls = []

  def run(kind, limit):
    calls.append(kind)
    return 1e-3 * limit * (1 + kind), limit

  first = costs.table_for("program-a", s, 2, run)
  assert first.source == "measured" and calls
  measured = len(calls)
  assert costs.table_for("program-a", s, 2, run) is first and len(calls) == measured
  saved = json.loads((tmp_path / costs.SUBDIR / "program-a.json").read_text())
  assert saved["seconds"] == list(first.seconds)
  monkeypatch.setattr(costs, "_TABLES", {})  # a restart: the file is read, nothing timed
  again = costs.table_for("program-a", s, 2, run)
  assert again.source == "reused" and again.seconds == first.seconds and len(calls) == measured
  fixed = costs.table_for("program-b", s.replace(wide_cost=7.0), 2, run)
  assert len(calls) == measured
  np.testing.assert_allclose(fixed.cost_K, [1.0, 1 + 6 * 3 / 7, 7.0], rtol=1e-6)


def test_a_program_key_changes_with_the_package_code(monkeypatch):
  """A table measured by other code (an upgrade, an edited loop) is not reused."""
  key = costs.program_key("config", (4, 16))
  assert costs.program_key("config", (4, 16)) == key != costs.program_key("config", (4, 32))
  monkeypatch.setattr(costs, "code_digest", lambda: "other code")
  costs.program_key.cache_clear()  # keys are kept for the process, whose code is one
  assert costs.program_key("config", (4, 16)) != key
  costs.program_key.cache_clear()


def _oracle_drafts(monkeypatch, ntp_texts, accepted, seed=0, sure=False):
  """Drafts accepted by construction (`benchmarks.synthetic_acceptance.oracle_drafts`): NTP's
  own token where `accepted(slot_BP, st)` holds, one NTP did not choose elsewhere. Programs
  compiled before are dropped, and again after the test."""
  jax.clear_caches()
  monkeypatch.setattr(reveal, "pick_rows", oracle_drafts(ntp_texts, accepted, seed, sure))


@pytest.fixture
def clear_after():
  yield
  jax.clear_caches()


def _table_time(out, s) -> np.ndarray:
  """Each prompt's decode time by the fixed cost table of `s.wide_cost` (one-token forwards)."""
  return out.batch_kind_forwards @ costs.fixed(s, 1).cost_K


def test_drafts_that_fail_early_and_then_succeed_are_drafted_again(model, monkeypatch, clear_after):
  """At a wide forward's cost of 2.7 one-token ones, a row whose first drafts all fail runs NTP's
  forwards; once its drafts succeed, a probe finds it and it drafts again for the rest of the
  answer: NTP's text at far fewer forwards, and in less time than NTP's by the table. (A row
  that stayed in NTP's forwards would take all 96, and each probe would add to its time.)"""
  s = decode_settings(block_size=4, max_new_tokens=96, verify=True).replace(eos_id=-1)
  s = s.replace(wide_cost=2.7)
  prompt = [MORE[1]]
  ntp = sampler.decode(model, prompt, s.replace(mode="ntp"))
  _oracle_drafts(monkeypatch, ntp.tokens, lambda slot_BP, st: slot_BP >= 16)
  out = sampler.decode(model, prompt, s)
  assert out.tokens == ntp.tokens
  assert int(out.nfe[0]) < 0.6 * int(ntp.nfe[0]), (out.nfe, out.batch_kind_forwards)
  assert _table_time(out, s)[0] < 0.95 * int(ntp.nfe[0])


@pytest.mark.parametrize(
  "wide_cost, batch_size",
  [
    pytest.param(10.0, 1, marks=pytest.mark.integration),
    (10.0, None),
    (3.0, 1),
    pytest.param(3.0, None, marks=pytest.mark.integration),
  ],
)
def test_drafts_rarely_accepted_cost_a_few_wide_forwards_more_than_ntp(
  model, monkeypatch, clear_after, wide_cost, batch_size
):
  """A wide forward of the block costing 10 (or 3) one-token ones, drafts accepted one time in
  ten: each answer takes NTP's text at most NTP's forwards, and by the table's own measure at
  most NTP's time plus four wide forwards of the block, alone and in a batch. (At 10 even
  drafts always accepted would not pay with blocks of 4: nothing is probed; at 3 they would.)"""
  s = decode_settings(block_size=4, max_new_tokens=64, verify=True).replace(eos_id=-1)
  s = s.replace(wide_cost=wide_cost)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp"))
  hashed = lambda slot_BP, st: (slot_BP * 7919) % 10 == 3  # noqa: E731
  _oracle_drafts(monkeypatch, ntp.tokens, hashed)
  sm = sampler.SamplingModel.of(model)  # one prior across the prompts
  out = sampler.decode(sm, MORE, s, batch_size=batch_size)
  assert out.tokens == ntp.tokens
  assert (out.nfe <= ntp.nfe).all()
  assert out.accepted_tokens.sum() <= out.draft_tokens.sum() / 4
  # Each call's time once (a batch's rows share their call's counts), against NTP's: its
  # answers' forwards alone, or the batch's.
  calls = len(MORE) if batch_size == 1 else 1
  spent = _table_time(out, s).sum() / (len(MORE) // calls)
  ntp_time = ntp.nfe.sum() if batch_size == 1 else ntp.nfe.max()
  assert spent <= ntp_time + 4 * wide_cost * calls, (spent, ntp_time, out.batch_kind_forwards)


@pytest.mark.parametrize("q", [0.05, 0.3, 0.5, 0.7, 0.9, 0.99])
@pytest.mark.parametrize(
  "cost_K", [[1.0, 1.2, 1.5], [1.0, 2.0, 3.0], [1.0, 1.8, 3.6], [1.0, 9.0, 10.0]]
)
def test_drafts_pay_on_the_host_where_the_policy_would_go_wide_for_a_row_at_the_prior(q, cost_K):
  """`acceptance_prior.drafts_pay` (the host's call-level choice) agrees with `policy.choose` (the
  device's) for a fresh row, whose estimate is the prior: wide exactly where drafts pay. The
  prior falls with position, as drafts deeper in a block do."""
  s = decode_settings(block_size=4, verify=True, max_new_tokens=64)
  prior_P = np.asarray([1.0, q, q**1.2, q**1.5], np.float32)
  st = initial_state(
    s, KVCache.empty(peaky_model().cfg, 1, 80), prompt_keys(0, jnp.arange(1)), jnp.zeros(1, bool),
    True, verify=jnp.ones(1, bool), tuning=Tuning.of(cost_K, prior_P, learned=True, block_size=4),
  )  # fmt: skip
  st = st.replace(estimates=st.estimates.replace(probe_at_B=jnp.full(1, 10**6, jnp.int32)))
  wide = int(policy.choose(st, jnp.ones(1, bool), s)) != policy.NTP
  assert acceptance_prior.drafts_pay(prior_P, cost_K, s.draft_widths) == wide


def test_calls_run_ntp_where_drafts_do_not_pay_at_the_prior_and_verify_at_doubling_gaps():
  """`Prior.verifies_next`: nothing seen, every call verifies; drafts that do not pay at the
  learned prior send calls to NTP's program, with a verified call after 2, 4, 8, ... of them
  (at most MAX_CALL_GAP); once they pay, every call verifies and the gap starts again."""
  cost_K, widths = [1.0, 2.0, 3.0], (2, 4)
  prior = acceptance_prior.Prior()
  assert all(prior.verifies_next(cost_K, widths) for _ in range(3))  # nothing learned
  prior.add(tried_P=[0, 21], rejected_P=[0, 20])
  runs = [prior.verifies_next(cost_K, widths) for _ in range(16)]
  assert runs == [False] * 2 + [True] + [False] * 4 + [True] + [False] * 8
  many = [prior.verifies_next(cost_K, widths) for _ in range(2000)]
  gaps = np.diff(np.flatnonzero(many))
  assert gaps.max() == acceptance_prior.MAX_CALL_GAP + 1
  prior.add(tried_P=[0, 402], rejected_P=[0, 2])  # drafts that pay now
  assert all(prior.verifies_next(cost_K, widths) for _ in range(5))
  prior.add(tried_P=[0, 800], rejected_P=[0, 800])
  assert [prior.verifies_next(cost_K, widths) for _ in range(3)] == [False, False, True]


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.integration)])
def test_where_drafts_never_pay_calls_run_ntp_and_decode_its_text(
  model, monkeypatch, clear_after, temperature
):
  """Drafts never accepted, a wide forward costing 3 one-token ones, one prompt a call: the
  first call verifies (nothing is known), the next two run NTP's program (its forwards
  exactly), the fourth verifies again; every answer is NTP's text (greedy, and sampled with
  one seed)."""
  s = decode_settings(block_size=4, max_new_tokens=24, verify=True, temperature=temperature)
  s = s.replace(eos_id=-1, wide_cost=3.0)
  prompts = MORE
  ntp = sampler.decode(model, prompts, s.replace(mode="ntp"), seed=5)
  _oracle_drafts(monkeypatch, ntp.tokens, lambda slot_BP, st: slot_BP < 0, seed=5)
  sm = sampler.SamplingModel.of(model)
  out = sampler.decode(sm, prompts, s, seed=5, batch_size=1)
  assert out.tokens == ntp.tokens
  assert out.ntp_calls == 3 and (out.draft_tokens[[1, 2, 4]] == 0).all()
  assert out.draft_tokens[0] > 0 and out.accepted_tokens.sum() == 0
  np.testing.assert_array_equal(out.nfe[[1, 2, 4]], ntp.nfe[[1, 2, 4]])
  assert (out.batch_kind_forwards[[1, 2, 4], 0] == ntp.nfe[[1, 2, 4]] - 1).all()
  assert (out.batch_kind_forwards[[1, 2, 4], 1:] == 0).all()


def test_the_prefill_drafts_where_the_batch_would_go_wide_or_while_nothing_is_learned():
  """`policy.prefill_drafts` on fresh states: blocks of 4 (widths 2 and 4) at costs 1, 2, 3.
  A prior of 0.95 drafts (a run of blocks settles 3.44 > 3 a forward); a learned prior of 0.2
  does not; the same 0.2 with nothing learned drafts (all accepted, a block would pay: the
  prefill probes). At a wide forward's cost of 10 nothing could pay: no drafts, learned or
  not. A forced kind decides."""
  s = decode_settings(block_size=4, verify=True, max_new_tokens=32)

  def drafts(cost_K, prior, learned=True, force=-1, verify=True):
    st = initial_state(
      s, KVCache.empty(peaky_model().cfg, 2, 40), prompt_keys(0, jnp.arange(2)),
      jnp.zeros(2, bool), True, verify=jnp.full((2,), verify),
      tuning=Tuning.of(cost_K, prior, force, learned, block_size=4),
    )  # fmt: skip
    return bool(policy.prefill_drafts(st, jnp.ones(2, bool), s))

  assert drafts([1.0, 2.0, 3.0], 0.95)
  assert not drafts([1.0, 2.0, 3.0], 0.2)
  assert drafts([1.0, 2.0, 3.0], 0.2, learned=False)
  assert not drafts([1.0, 10.0, 10.0], 0.9, learned=False)
  assert drafts([1.0, 10.0, 10.0], 0.2, verify=False)  # a plain row's block 0 needs it
  assert not drafts([1.0, 2.0, 3.0], 0.9, force=0)
  assert drafts([1.0, 10.0, 10.0], 0.2, force=2)


@pytest.mark.integration
@pytest.mark.parametrize("refill", [False, True])
def test_the_prefill_drafts_only_where_the_policy_would_go_wide(model, refill):
  """Where a wide forward of a block of 4 costs 10 one-token ones (no acceptance would pay),
  the verified prefill is NTP's, the prompt alone: nothing is drafted, no forward is wide, and
  each answer is NTP's text at NTP's forwards. At one cost the prefill drafts block 0 (the
  fused prefill), and NTP's text stays."""
  s = decode_settings(block_size=4, max_new_tokens=24, verify=True).replace(refill=refill)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp", refill=False))
  out = sampler.decode(model, MORE, s.replace(wide_cost=10.0), batch_size=2)
  assert out.tokens == ntp.tokens
  assert out.drafts.sum() == 0 and out.wide_forwards == 0, (out.drafts, out.wide_forwards)
  np.testing.assert_array_equal(out.nfe, ntp.nfe)
  fused = sampler.decode(model, MORE, s.replace(wide_cost=1.0), batch_size=2)
  assert fused.tokens == ntp.tokens
  assert (fused.drafts > 0).all(), fused.drafts


POLICY_SETTINGS = {
  "measured": dict(),
  "fixed 1": dict(wide_cost=1.0),
  "fixed 3": dict(wide_cost=3.0),
  "fixed 10": dict(wide_cost=10.0),
}


@pytest.mark.parametrize(
  "block_size, policy_name, temperature, batch_size, refill",
  [
    (4, "measured", 0.0, None, False),
    pytest.param(8, "fixed 3", 1.0, 2, False, marks=pytest.mark.integration),
    pytest.param(4, "fixed 10", 0.7, 2, True, marks=pytest.mark.integration),
    pytest.param(8, "measured", 0.0, 1, False, marks=pytest.mark.integration),
    pytest.param(4, "fixed 1", 1.0, None, False, marks=pytest.mark.integration),
    pytest.param(8, "fixed 10", 0.0, 2, True, marks=pytest.mark.integration),
  ],
)
def test_every_choice_of_forwards_keeps_ntps_text_at_no_more_forwards(
  model, block_size, policy_name, temperature, batch_size, refill
):
  """Whatever the costs make the decode choose (NTP's forwards, narrow and wide ones, probes),
  the text is NTP's token for token, greedy and sampled with one seed, and no answer takes more
  forwards than NTP's; alone, in batches and refilled."""
  eos = sampler.decode(model, PROMPTS, decode_settings(mode="ntp", max_new_tokens=4)).tokens[0][2]
  s = decode_settings(block_size=block_size, max_new_tokens=24, verify=True, gamma=1.0)
  s = s.replace(eos_id=eos, temperature=temperature, refill=refill, **POLICY_SETTINGS[policy_name])
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp", refill=False), seed=4)
  out = sampler.decode(model, MORE, s, seed=4, batch_size=batch_size)
  assert out.tokens == ntp.tokens
  assert (out.nfe <= ntp.nfe).all(), (out.nfe, ntp.nfe)
  assert out.cost_table is not None


@pytest.mark.parametrize(
  "block_size, width",
  [
    pytest.param(8, 2, marks=pytest.mark.integration),
    (8, 4),
    pytest.param(4, 2, marks=pytest.mark.integration),
  ],
)
def test_a_narrow_forward_equals_the_uncached_reference_of_its_width(
  model, monkeypatch, block_size, width
):
  """Every forward after the prefill forced to width D (`Tuning.force`: the runs cut to D
  tokens, blocks of D drafted): tokens, reveal steps and NFE equal the uncached reference that
  drafts blocks of D, and the text is NTP's. Forced, no row ends at an EOS."""
  s = decode_settings(block_size=block_size, max_new_tokens=20, verify=True, gamma=1.0)
  s = s.replace(eos_id=-1, wide_cost=1.0)
  kind = 1 + s.draft_widths.index(width)
  forced = Tuning.of(np.ones(1 + len(s.draft_widths)), force=kind, block_size=s.block_size)
  monkeypatch.setattr(sampler, "_tuning", lambda *a, **k: (forced, None))
  out = sampler.decode(model, MORE, s)
  assert (out.batch_kind_forwards[:, kind] == out.batch_kind_forwards.sum(axis=1)).all()
  for i, prompt in enumerate(MORE):
    tokens, steps, nfe, _ = reference_verified(model, prompt, s, width=width)
    assert (out.tokens[i], out.reveal_step[i], int(out.nfe[i])) == (tokens, steps, nfe), i
    assert out.tokens[i] == reference_ntp(model, prompt, s)[0]
    assert MASK not in out.tokens[i]


@pytest.mark.integration
@pytest.mark.parametrize("case", ["sampled, probing", "constrained, mixed, refilled"])
def test_ntps_forwards_run_without_the_policy_change_nothing(model, monkeypatch, clear_after, case):
  """The NTP forwards that nothing can change the choice of run without the checks' and the
  policy's work (`policy.unchanged_for`, `verify.settle_next`): the decode is the one that
  checks and chooses at every forward, forward for forward: tokens, reveal steps, NFE, kinds of
  forward, drafts accepted and rejected, forced tokens and completion."""
  s = decode_settings(block_size=4, max_new_tokens=48, verify=True, gamma=1.0)
  kw = {}
  if case == "sampled, probing":  # drafts rarely accepted: probes between stretches of NTP's
    s = s.replace(wide_cost=3.0, temperature=0.8)
    ntp = sampler.decode(model, MORE, s.replace(mode="ntp"), seed=3)
    _oracle_drafts(monkeypatch, ntp.tokens, lambda slot_BP, st: (slot_BP * 7919) % 10 == 3, seed=3)
  else:
    from sbd_jax.constrain.spec import Constraint
    from sbd_jax.data.tokenizer import ByteTokenizer

    s = s.replace(wide_cost=10.0, refill=True)
    regex = Constraint.regex(r"[a-z]{2,9}( [a-z]{2,9}){1,3}\.")
    constraints = [regex, None, regex, None, regex]
    kw = dict(tokenizer=ByteTokenizer(), constraints=constraints, batch_size=2)

  def decoded():
    out = sampler.decode(sampler.SamplingModel.of(model), MORE, s, seed=3, **kw)
    fields = ("nfe", "batch_kind_forwards", "rollbacks", "draft_tokens", "accepted_tokens")
    fields += ("forced_tokens", "complete") if "batch_size" in kw else ()
    return out.tokens, out.reveal_step, [np.asarray(getattr(out, f)).tolist() for f in fields]

  stretched = decoded()
  jax.clear_caches()
  monkeypatch.setattr(policy, "unchanged_for", lambda st, active_B, s: jnp.int32(0))
  assert decoded() == stretched


def test_drafts_worse_deeper_in_the_block_are_drafted_at_the_width_that_pays(
  model, monkeypatch, clear_after
):
  """Drafts right at 0.98 at block positions 1-3 and 0.3 after them, blocks of 8 at a wide
  cost of 4 (widths 2, 4, 8 at 1.6, 2.4, 4): a run of 4-wide forwards settles 3.72 tokens a
  forward (1.55 per unit of cost), 8-wide ones 2.65 (0.66). A single q fitted to the drafts a
  4-wide forward tries (0.98) would value 8-wide ones at 6.7 (1.68) and keep trying them. Once
  the model's prior has learned acceptance by position (the first two calls: the first, NTP's
  forwards and a few probes, at Laplace's prior), calls draft 4 wide: NTP's text, and by the
  table's measure within 10 % of the 4-wide run's time per token."""
  s = decode_settings(block_size=8, max_new_tokens=96, verify=True).replace(eos_id=-1)
  s = s.replace(wide_cost=4.0)
  ntp = sampler.decode(model, MORE, s.replace(mode="ntp"))
  q_P = [1.0, 0.98, 0.98, 0.98, 0.3, 0.3, 0.3, 0.3]
  _oracle_drafts(monkeypatch, ntp.tokens, geometric(q_P, seed=1), sure=True)
  sm = sampler.SamplingModel.of(model)
  out = sampler.decode(sm, MORE, s, batch_size=1)
  assert out.tokens == ntp.tokens
  later = out.batch_kind_forwards[2:]
  assert later[:, 2].sum() >= 0.9 * later[:, 1:].sum(), later
  time_per_token = _table_time(out, s)[2:].sum() / sum(map(len, out.tokens[2:]))
  assert time_per_token < 1.1 * 2.4 / 3.72, (time_per_token, later)
