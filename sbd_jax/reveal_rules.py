"""Which masked block positions to reveal after one SBD forward (paper section 3 rules).

Every rule is a pure function (logp_BPV, open_BP, gamma) -> reveal_BP over the still-masked
("open") positions of a block. Dimension letters (docs/dimensions.md): B batch, P block positions, V vocabulary.
`logp_BPV` are log-probabilities of the distribution tokens are drawn from; the sampler sets the
mask token's logit to -inf before computing them, so entropies and confidences never count it.

Ordering is exact and deterministic: positions are sorted with a stable sort, so ties keep
position order (left first). Every rule reveals at least one open position when one exists, and
`gamma == 0` reveals exactly one (the first in the rule's order).
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


def _reveal_in_order(
  sort_key_BP: jax.Array, open_BP: jax.Array, accept: Callable[[jax.Array], jax.Array], gamma: float
) -> jax.Array:
  """Sort open positions by `sort_key` ascending (stable), reveal the accepted ranks.

  `accept(perm_BP)` returns [B, P] bools by rank; it must be monotone (a prefix). Rank 0 is
  always revealed; with gamma == 0 only rank 0 is.
  """
  key_BP = jnp.where(open_BP, sort_key_BP, jnp.inf)  # closed positions sort last
  perm_BP = jnp.argsort(key_BP, axis=-1, stable=True)
  rank0_BP = jnp.arange(open_BP.shape[-1]) == 0
  by_rank_BP = rank0_BP | (accept(perm_BP) & (gamma > 0))  # gamma may be traced
  inverse_BP = jnp.argsort(perm_BP, axis=-1)
  return jnp.take_along_axis(by_rank_BP, inverse_BP, axis=-1) & open_BP


def eb_entropy(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """EB-Sampler, entropy proxy (eq. 8): sort by entropy ascending; reveal the largest s >= 1
  with H(1) + ... + H(s-1) <= gamma."""
  h_BP = entropy(logp_BPV)

  def accept(perm_BP):
    h_sorted = jnp.take_along_axis(jnp.where(open_BP, h_BP, 0.0), perm_BP, axis=-1)
    before = jnp.cumsum(h_sorted, axis=-1) - h_sorted  # H(1) + ... + H(s-1) for rank s-1
    return before <= gamma

  return _reveal_in_order(h_BP, open_BP, accept, gamma)


def eb_confidence(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """EB-Sampler, confidence proxy (eq. 18): sort by max_v p(v) descending; reveal the largest s
  with sum_{j<=s} H(j) - max_{j<=s} H(j) <= gamma."""
  h_BP = entropy(logp_BPV)

  def accept(perm_BP):
    h_sorted = jnp.take_along_axis(jnp.where(open_BP, h_BP, 0.0), perm_BP, axis=-1)
    bound = jnp.cumsum(h_sorted, axis=-1) - jax.lax.cummax(h_sorted, axis=h_sorted.ndim - 1)
    return bound <= gamma

  return _reveal_in_order(-confidence(logp_BPV), open_BP, accept, gamma)


def factor(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """Factor rule in Fast-dLLM's form: sort by confidence c descending; reveal the largest n with
  (n + 1) * (1 - c(n)) < f (f = gamma), at least one.

  The SBD paper prints "(n+1) c_n < f"; we follow Fast-dLLM (Wu et al. 2025), whose form makes
  a larger f reveal more tokens, like gamma in the EB rules.
  """
  c_BP = confidence(logp_BPV)

  def accept(perm_BP):
    c_sorted = jnp.take_along_axis(c_BP, perm_BP, axis=-1)
    n = jnp.arange(1, c_sorted.shape[-1] + 1)
    return (n + 1) * (1.0 - c_sorted) < gamma

  return _reveal_in_order(-c_BP, open_BP, accept, gamma)


def fixed(logp_BPV: jax.Array, open_BP: jax.Array, gamma: float) -> jax.Array:
  """A forced schedule for measurements: reveal the floor(gamma) most confident open positions
  (at least one), so a block of k open positions costs exactly ceil(k / floor(gamma)) forwards
  whatever the model predicts."""
  c_BP = confidence(logp_BPV)

  def accept(perm_BP):
    return jnp.broadcast_to(jnp.arange(perm_BP.shape[-1]) < jnp.floor(gamma), perm_BP.shape)

  return _reveal_in_order(-c_BP, open_BP, accept, gamma)


RULES: dict[str, Rule] = {
  "eb_entropy": eb_entropy,
  "eb_confidence": eb_confidence,
  "factor": factor,
  "fixed": fixed,
}


def get_rule(name: str) -> Rule:
  """The rule called `name`; a one-line ValueError for an unknown name."""
  if name not in RULES:
    raise ValueError(f"unknown reveal rule {name!r}; choose one of {sorted(RULES)}")
  return RULES[name]
