"""Reveal rules against hand-computed entropies and confidences on literal distributions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbd_jax.evals import first_forward

# Four block positions over a 4-token vocabulary, with entropies (nats) and confidences:
from sbd_jax.sbd import reveal_rules

#   pos 0: one-hot               H = 0              c = 1.0
#   pos 1: [.5, .5]              H = ln 2 = 0.6931  c = 0.5
#   pos 2: uniform over 4        H = ln 4 = 1.3863  c = 0.25
#   pos 3: [.9, .1]              H = 0.3251         c = 0.9
PROBS = [[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25] * 4, [0.9, 0.1, 0, 0]]
H = [0.0, math.log(2), math.log(4), -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))]


def _logp(probs):
  with np.errstate(divide="ignore"):
    return jnp.log(jnp.asarray([probs], jnp.float32))


def _reveal(rule, probs, gamma, open_=None):
  open_ = [True] * len(probs) if open_ is None else open_
  out = reveal_rules.get_rule(rule)(_logp(probs), jnp.asarray([open_]), gamma)
  return [int(i) for i in np.flatnonzero(np.asarray(out[0]))]


def test_entropy_and_confidence_values():
  np.testing.assert_allclose(reveal_rules.entropy(_logp(PROBS))[0], H, atol=1e-6)
  np.testing.assert_allclose(
    reveal_rules.confidence(_logp(PROBS))[0], [1, 0.5, 0.25, 0.9], atol=1e-6
  )


@pytest.mark.parametrize(
  "gamma, expected",
  [
    (0.0, [0]),  # exactly one, even though H(1) = 0 would admit a second at <= 0
    (0.3, [0, 3]),  # H(1) = 0 <= .3; H(1)+H(2) = .325 > .3
    (0.35, [0, 1, 3]),  # .325 <= .35; + ln2 = 1.018 > .35
    (1.1, [0, 1, 2, 3]),
  ],
)
def test_eb_entropy(gamma, expected):
  assert _reveal("eb_entropy", PROBS, gamma) == expected


def test_eb_entropy_respects_open_mask_and_reveals_at_least_one():
  # Position 0 is already revealed: sorted open = 3 (.325), 1 (.693), 2 (1.386).
  assert _reveal("eb_entropy", PROBS, 0.3, [False, True, True, True]) == [3]
  assert _reveal("eb_entropy", PROBS, 0.35, [False, True, True, True]) == [1, 3]
  assert _reveal("eb_entropy", PROBS, 1.05, [False, True, True, True]) == [1, 2, 3]
  # Only high-entropy positions open, tiny gamma: still one (the lowest entropy).
  assert _reveal("eb_entropy", PROBS, 1e-3, [False, True, True, False]) == [1]
  assert _reveal("eb_entropy", PROBS, 5.0, [False] * 4) == []


def test_ties_break_by_position():
  tied = [[0.5, 0.5, 0, 0]] * 4
  for rule in reveal_rules.RULES:
    assert _reveal(rule, tied, 0.0) == [0]
    assert _reveal(rule, tied, 0.0, [False, False, True, True]) == [2]
  # Two ties at H = ln2: gamma admits exactly two of four -> the two leftmost.
  assert _reveal("eb_entropy", tied, 0.7) == [0, 1]


@pytest.mark.parametrize(
  "gamma, expected",
  [
    (0.0, [0]),
    (0.3, [0, 3]),  # bounds by rank: 0, 0, .325, 1.018
    (0.33, [0, 1, 3]),
    (1.1, [0, 1, 2, 3]),
  ],
)
def test_eb_confidence(gamma, expected):
  assert _reveal("eb_confidence", PROBS, gamma) == expected


def test_eb_confidence_orders_by_confidence_not_entropy():
  # pos 0: [.6, .2, .2] c=.6 H=.9503; pos 1: [.55, .45] c=.55 H=.6881.
  probs = [[0.6, 0.2, 0.2, 0], [0.55, 0.45, 0, 0]]
  h0 = -(0.6 * math.log(0.6) + 2 * 0.2 * math.log(0.2))
  h1 = -(0.55 * math.log(0.55) + 0.45 * math.log(0.45))
  assert h0 > h1  # the entropy order is the reverse of the confidence order
  assert _reveal("eb_confidence", probs, 0.1) == [0]  # bound(2) = h0 + h1 - h0 = .688
  assert _reveal("eb_confidence", probs, 0.7) == [0, 1]
  assert _reveal("eb_entropy", probs, 0.1) == [1]


@pytest.mark.parametrize(
  "f, expected",
  [
    (0.0, [0]),
    (0.2, [0]),  # (n+1)(1-c(n)) by n: 0, .3, 2, 3.75; n=1 is always revealed
    (0.5, [0, 3]),
    (2.5, [0, 1, 3]),
    (4.0, [0, 1, 2, 3]),
  ],
)
def test_factor(f, expected):
  assert _reveal("factor", PROBS, f) == expected


def test_factor_at_least_one_when_nothing_is_confident():
  probs = [[0.25] * 4, [0.3, 0.3, 0.2, 0.2], [0.25] * 4]
  assert _reveal("factor", probs, 0.1) == [1]  # highest confidence, threshold never met


@pytest.mark.parametrize(
  "gamma, open_, expected",
  [
    (0.0, None, [0]),  # exactly one: the lowest entropy
    (0.3, None, [0]),  # H = 0 only
    (0.5, None, [0, 3]),  # .325 < .5: unlike EB, the sum of entropies is not bounded
    (1.0, None, [0, 1, 3]),
    (2.0, None, [0, 1, 2, 3]),
    (0.3, [False, True, True, False], [1]),  # nothing below γ: the lowest entropy alone
  ],
)
def test_threshold(gamma, open_, expected):
  assert _reveal("threshold", PROBS, gamma, open_) == expected


def test_threshold_never_commits_an_uncertain_position_beside_confident_ones():
  """One flat position among confident ones: EB reveals it with them in the first forward
  (the bound counts the entropies ranked before it), the threshold rule leaves it."""
  probs = [[1.0, 0, 0, 0]] * 3 + [[0.25] * 4]
  assert _reveal("eb_entropy", probs, 0.1) == [0, 1, 2, 3]
  assert _reveal("threshold", probs, 0.1) == [0, 1, 2]


@pytest.mark.parametrize(
  "tau, open_, expected",
  [
    (0.95, None, [0]),  # c = 1 only
    (0.85, None, [0, 3]),  # .9 > .85
    (0.4, None, [0, 1, 3]),
    (1.0, None, [0]),  # nothing exceeds 1: the most confident alone
    (0.95, [False, True, True, False], [1]),  # the most confident of the open ones
  ],
)
def test_confidence_threshold(tau, open_, expected):
  assert _reveal("confidence_threshold", PROBS, tau, open_) == expected


@pytest.mark.parametrize("tau", [0.0, -0.5, 1.5, float("nan")])
def test_confidence_threshold_outside_0_1_is_refused_in_one_line(tau):
  from sbd_jax.decode.settings import SamplerSettings

  with pytest.raises(ValueError, match=r"threshold in \(0, 1\]") as info:
    SamplerSettings(eos_id=1, mask_id=2, pad_id=0, rule="confidence_threshold", gamma=tau)
  assert "\n" not in str(info.value)


def test_batched_rows_are_independent():
  logp = jnp.concatenate([_logp(PROBS), _logp(PROBS[::-1])])
  out = np.asarray(reveal_rules.eb_entropy(logp, jnp.ones((2, 4), bool), 0.3))
  assert np.flatnonzero(out[0]).tolist() == [0, 3]
  assert np.flatnonzero(out[1]).tolist() == [0, 3]  # reversed: pos 3 is one-hot, pos 0 is .9/.1


def test_fixed_reveals_the_r_most_confident():
  logp = jnp.log(jnp.asarray([[[0.9, 0.1], [0.6, 0.4], [0.99, 0.01], [0.5, 0.5]]]))
  open_ = jnp.asarray([[True, True, True, True]])
  assert reveal_rules.fixed(logp, open_, 2.0).tolist() == [[True, False, True, False]]
  assert reveal_rules.fixed(logp, open_, 0.0).tolist() == [[False, False, True, False]]
  closed = open_.at[0, 2].set(False)
  assert reveal_rules.fixed(logp, closed, 2.0).tolist() == [[True, True, False, False]]


def test_unknown_rule():
  with pytest.raises(ValueError, match="unknown reveal rule"):
    reveal_rules.get_rule("nope")


@pytest.mark.parametrize("gamma", [0.0, 0.05, 0.35, 1.0])
def test_diagnostics_first_forward_matches_eb_entropy_on_blocks_laid_out_anywhere(gamma):
  """first_forward.eb_entropy_first_forward (blocks found by id anywhere in a row, as completion-
  anchored blocks lie in packed rows) reveals what eb_entropy reveals block by block, with
  closed positions and exact ties."""
  rng = np.random.default_rng(0)
  b, nb, k, v = 3, 6, 4, 7
  scale = rng.choice([0.3, 3.0, 30.0], size=(b, nb, k, 1))
  logits = rng.normal(size=(b, nb, k, v)) * scale
  logits[:, 0] = logits[:, 0, :1]  # block 0: identical distributions, equal entropies
  logits[:, 1] = np.where(np.arange(v) == 0, 0.0, -1e9)  # block 1: certain, entropy exactly 0
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
  open_ = rng.random((b, nb, k)) < 0.7
  expected = reveal_rules.eb_entropy(
    logp.reshape(b * nb, k, v), jnp.asarray(open_.reshape(b * nb, k)), gamma
  )
  # Interleave the blocks: row index j * nb + block keeps each block's positions in order.
  to_row = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, k * nb)  # noqa: E731
  got = first_forward.eb_entropy_first_forward(
    to_row(reveal_rules.entropy(logp)),
    to_row(jnp.asarray(open_)),
    to_row(jnp.broadcast_to(jnp.arange(nb)[None, :, None], (b, nb, k))),
    gamma,
  )
  np.testing.assert_array_equal(got, to_row(expected.reshape(b, nb, k)))
  assert int(got.sum()) > (b * nb if gamma > 0 else 0)  # blocks reveal several tokens


def _sorted_reference(rule, logp_BPV, open_BP, gamma):
  """Each rule as the paper states it: sort the open positions (stable argsort), walk the
  sorted order with cumulative sums / maxima, map the accepted ranks back (numpy, float64)."""
  logp = np.asarray(logp_BPV, np.float64)
  p = np.exp(logp)
  h = -np.sum(np.where(p > 0, p * logp, 0.0), axis=-1)
  c = np.exp(np.max(logp, axis=-1))
  key = {"eb_entropy": h, "threshold": h}.get(rule, -c)
  out = np.zeros(open_BP.shape, bool)
  for b in range(open_BP.shape[0]):
    perm = np.argsort(np.where(open_BP[b], key[b], np.inf), kind="stable")
    h_sorted = np.where(open_BP[b], h[b], 0.0)[perm]
    if rule == "eb_entropy":
      accept = np.cumsum(h_sorted) - h_sorted <= gamma
    elif rule == "eb_confidence":
      accept = np.cumsum(h_sorted) - np.maximum.accumulate(h_sorted) <= gamma
    elif rule == "factor":
      accept = (np.arange(len(perm)) + 2) * (1.0 - c[b][perm]) < gamma
    elif rule == "threshold":
      accept = h[b][perm] < gamma
    elif rule == "confidence_threshold":
      accept = c[b][perm] > gamma
    else:
      accept = np.arange(len(perm)) < np.floor(gamma)
    accept = (np.arange(len(perm)) == 0) | (accept & (gamma > 0))
    out[b, perm] = accept
  return out & open_BP


@pytest.mark.parametrize("rule", sorted(reveal_rules.RULES))
def test_rules_equal_the_sorted_reference_on_random_blocks_with_ties(rule):
  """The rank-by-comparison implementation reveals what sorting would, including ties (equal
  keys keep position order): 300 blocks of 16 over 12 tokens, rows duplicated for exact ties,
  random open masks, γ from 0 to past the block's total."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(300, 16, 12)) * rng.choice([0.3, 2.0, 6.0], size=(300, 1, 1))
  logits[:, 8:] = logits[:, :8]  # positions 8-15 tie with 0-7
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  open_BP = rng.random((300, 16)) < 0.7
  for gamma in (0.0, 0.05, 0.35, 1.0, 3.0, 7.5, 100.0):
    got = np.asarray(reveal_rules.get_rule(rule)(logp, jnp.asarray(open_BP), gamma))
    want = _sorted_reference(rule, logp, open_BP, gamma)
    mismatched = np.flatnonzero((got != want).any(axis=-1))
    assert not len(mismatched), (gamma, mismatched[:5])
