"""Which masked block positions to reveal after one SBD forward (paper section 3 rules, and
two threshold rules).

Every rule is a pure function (logp_BPV, open_BP, gamma) -> reveal_BP over the still-masked
("open") positions of a block. Dimension letters (docs/dimensions.md): B batch, P block positions, V vocabulary.
`logp_BPV` are log-probabilities of the distribution tokens are drawn from; the sampler sets the
mask token's logit to -inf before computing them, so entropies and confidences never count it.

Ordering is exact and deterministic: positions are ranked as a stable sort would order them,
so ties keep position order (left first). Every rule reveals at least one open position when one
exists, and `gamma == 0` reveals exactly one (the first in the rule's order). `gamma` is the
rule's one parameter: γ of the EB and threshold rules, f of the factor rule, r of the forced
schedule, the probability τ of the confidence threshold (in (0, 1]: `check_gamma`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Rule = Callable[[jax.Array, jax.Array, float], jax.Array]


def entropy(logp_BPV: jax.Array) -> jax.Array:
  """Shannon entropy [B, P] in nats; zero-probability entries (logp = -inf) contribute 0."""
  p = jnp.exp(logp_BPV)
  return -jnp.sum(jnp.where(p > 0, p * logp_BPV, 0.0), axis=-1)


def confidence(logp_BPV: jax.Array) -> jax.Array:
  """Probability of the most likely token, max_v p(v), [B, P]."""
  return jnp.exp(jnp.max(logp_BPV, axis=-1))


def _precedes(sort_key_BP: jax.Array) -> jax.Array:
  """[B, P, P]: entry (i, j) is True when position j comes before position i in the stable
  ascending order of `sort_key` (smaller key, or an equal key further left)."""
  key_i, key_j = sort_key_BP[..., :, None], sort_key_BP[..., None, :]
  position = jnp.arange(sort_key_BP.shape[-1])
  left_of_i = position[None, :] < position[:, None]
  return (key_j < key_i) | ((key_j == key_i) & left_of_i)


def _reveal_in_order(
  sort_key_BP: jax.Array,
  open_BP: jax.Array,
  accept: Callable[[jax.Array, jax.Array], jax.Array],
  gamma: float,
) -> jax.Array:
  """Order open positions by `sort_key` ascending (stable; closed ones last) and reveal those
  whose place in that order `accept` admits; the first is always revealed, and with gamma == 0
  only the first.

  `accept(precedes_BPP, rank_BP)` gets, per position i, which positions come before it and its
  rank (0 = first), and returns [B, P] bools; the rules admit a prefix of the order. Ranks
  come from P x P comparisons rather than a sort: a block has at most a few dozen positions,
  and the comparisons fuse into the rule's other elementwise work, where two sorts per forward
  would not (sorting is slow on TPUs and a separate kernel on the CPU).
  """
  precedes_BPP = _precedes(jnp.where(open_BP, sort_key_BP, jnp.inf))
  rank_BP = jnp.sum(precedes_BPP, axis=-1)
  accepted_BP = (rank_BP == 0) | (accept(precedes_BPP, rank_BP) & (gamma > 0))  # gamma traced
  return accepted_BP & open_BP


def _sum_before(precedes_BPP: jax.Array, values_BP: jax.Array) -> jax.Array:
  """Per position i, the sum of `values` over the positions before i."""
  return jnp.sum(jnp.where(precedes_BPP, values_BP[..., None, :], 0.0), axis=-1)


def eb_entropy(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """EB-Sampler, entropy proxy (eq. 8): sort by entropy ascending; reveal the largest s >= 1
  with H(1) + ... + H(s-1) <= gamma."""
  h_BP = entropy(logp_BPV)

  def accept(precedes_BPP, rank_BP):
    return _sum_before(precedes_BPP, jnp.where(open_BP, h_BP, 0.0)) <= gamma

  return _reveal_in_order(h_BP, open_BP, accept, gamma)


def eb_confidence(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """EB-Sampler, confidence proxy (eq. 18): sort by max_v p(v) descending; reveal the largest s
  with sum_{j<=s} H(j) - max_{j<=s} H(j) <= gamma."""
  h_BP = jnp.where(open_BP, entropy(logp_BPV), 0.0)

  def accept(precedes_BPP, rank_BP):
    upto_BPP = precedes_BPP | jnp.eye(h_BP.shape[-1], dtype=bool)  # j <= i in the order
    total_BP = jnp.sum(jnp.where(upto_BPP, h_BP[..., None, :], 0.0), axis=-1)
    largest_BP = jnp.max(jnp.where(upto_BPP, h_BP[..., None, :], -jnp.inf), axis=-1)
    return total_BP - largest_BP <= gamma

  return _reveal_in_order(-confidence(logp_BPV), open_BP, accept, gamma)


def factor(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """Factor rule in Fast-dLLM's form: sort by confidence c descending; reveal the largest n with
  (n + 1) * (1 - c(n)) < f (f = gamma), at least one.

  The SBD paper prints "(n+1) c_n < f"; we follow Fast-dLLM (Wu et al. 2025), whose form makes
  a larger f reveal more tokens, like gamma in the EB rules.
  """
  c_BP = confidence(logp_BPV)

  def accept(precedes_BPP, rank_BP):
    return (rank_BP + 2) * (1.0 - c_BP) < gamma  # n = rank + 1

  return _reveal_in_order(-c_BP, open_BP, accept, gamma)


def fixed(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """A forced schedule for measurements: reveal the floor(gamma) most confident open positions
  (at least one), so a block of k open positions costs exactly ceil(k / floor(gamma)) forwards
  whatever the model predicts."""

  def accept(precedes_BPP, rank_BP):
    return rank_BP < jnp.floor(gamma)

  return _reveal_in_order(-confidence(logp_BPV), open_BP, accept, gamma)


def threshold(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """Entropy threshold: reveal every open position whose entropy is below gamma, or, if none
  is, the one with the lowest entropy. Unlike EB it never commits an uncertain position
  because confident ones sit beside it."""
  h_BP = entropy(logp_BPV)

  def accept(precedes_BPP, rank_BP):
    return h_BP < gamma

  return _reveal_in_order(h_BP, open_BP, accept, gamma)


def confidence_threshold(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """Fast-dLLM's confidence threshold (Wu et al. 2025): reveal every open position whose top
  probability exceeds τ = gamma, or, if none does, the most confident one."""
  c_BP = confidence(logp_BPV)

  def accept(precedes_BPP, rank_BP):
    return c_BP > gamma

  return _reveal_in_order(-c_BP, open_BP, accept, gamma)


RULES: dict[str, Rule] = {
  "eb_entropy": eb_entropy,
  "eb_confidence": eb_confidence,
  "factor": factor,
  "fixed": fixed,
  "threshold": threshold,
  "confidence_threshold": confidence_threshold,
}

# The γ a compiled decode's static settings hold (γ itself is traced): valid for every rule.
TRACED_GAMMA = 1.0


def check_gamma(rule: str, gamma: float) -> None:
  """One-line ValueErrors for an unknown rule or a parameter outside its rule's range."""
  get_rule(rule)
  if rule == "confidence_threshold":
    if not 0 < gamma <= 1:
      raise ValueError(f"the confidence_threshold rule needs a threshold in (0, 1], got {gamma}")
  elif not gamma >= 0:  # NaN too
    raise ValueError(f"gamma must be >= 0, got {gamma}")


def one_per_forward(rule: str) -> float:
  """The parameter with which `rule` reveals exactly one position per forward."""
  return 1.0 if rule == "confidence_threshold" else 0.0


def get_rule(name: str) -> Rule:
  """The rule called `name`; a one-line ValueError for an unknown name."""
  if name not in RULES:
    raise ValueError(f"unknown reveal rule {name!r}; choose one of {sorted(RULES)}")
  return RULES[name]
