"""What a model's earlier verified rows accepted, kept on the host across decodes and requests
(`Prior`): the prior that new rows' estimates start from (`policy`: q0 by block position,
`Prior.by_position`), and whether a call runs its verified program at all.

Calls. Where a fresh row's drafts would not pay at the prior (`drafts_pay`), a verified program
would run NTP's forwards and probes only, at its bookkeeping's extra cost: `sampler` then runs
NTP's own program for most calls, and verified ones at doubling gaps (`Prior.verifies_next`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sbd_jax.decode.policy import NTP, hazards, prior_belief, settled_per_forward, survival

# The prior's memory, in draft tokens: older counts are scaled down past it, so the prior
# follows what the model's recent rows accepted.
PRIOR_HORIZON = 4096.0


# Calls run as NTP's own program between two verified ones, where drafts do not pay at the
# prior (`Prior.verifies_next`): the first gap, and the longest.
FIRST_CALL_GAP, MAX_CALL_GAP = 2, 64


# A position's prior leans on the model's acceptance over all positions as this many tokens
# (`Prior.by_position`): positions that few drafts reached take the overall rate.
POSITION_WEIGHT = 8.0


def drafts_pay(prior_P, cost_K, widths: tuple[int, ...]) -> bool:
  """Whether a fresh row at a learned prior `prior_P` (q0 by block position) settles more per
  unit of cost in a wide forward of some width than in NTP's (`policy._values`, for one row)."""
  cost_K = np.asarray(cost_K, np.float32)
  hazard_P = hazards(np.asarray(prior_P, np.float32), xp=np)
  moments = survival(*prior_belief(hazard_P, True, xp=np), hazard_P, max(widths), xp=np)
  settled_W = settled_per_forward(moments, widths, xp=np)
  return bool(np.max(settled_W / cost_K[1:]) > 1.0 / cost_K[NTP])


@dataclasses.dataclass
class Prior:
  """What a model's earlier verified rows accepted (host side), by block position: the q0 that
  new rows' estimates start from (`by_position`). Laplace's rule of succession with nothing
  seen: 0.5. And, where drafts do not pay at it, when a call next runs verified
  (`verifies_next`)."""

  tried: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # by position
  rejected: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
  ntp_calls: int = 0  # calls run as NTP's own program since the last verified one
  call_gap: int = FIRST_CALL_GAP  # such calls before the next verified one

  @property
  def value(self) -> float:
    """The share of draft tokens tried that were accepted, over all positions (Laplace's)."""
    tried, rejected = float(self.tried.sum()), float(self.rejected.sum())
    return (tried - rejected + 1.0) / (tried + 2.0)

  @property
  def learned(self) -> bool:
    """Whether any checked draft has been counted (`policy.Tuning.learned`)."""
    return float(self.tried.sum()) > 0

  def by_position(self, block_size: int) -> np.ndarray:
    """float32 [P]: q0 at each block position (`policy.Tuning.prior_P`): what was accepted there,
    leaning on `value` as POSITION_WEIGHT tokens; 1 at position 0, NTP's own token."""
    fit = lambda x: np.pad(x[:block_size], (0, max(block_size - len(x), 0)))  # noqa: E731
    tried, rejected = fit(self.tried), fit(self.rejected)
    q_P = (tried - rejected + POSITION_WEIGHT * self.value) / (tried + POSITION_WEIGHT)
    q_P[0] = 1.0
    return q_P.astype(np.float32)

  def verifies_next(self, cost_K, widths: tuple[int, ...]) -> bool:
    """Whether the next call of a decode that chooses its forwards runs its verified program,
    else NTP's own, whose text it equals (TensorRT-LLM likewise turns speculation off when
    acceptance drops). Where drafts pay at the prior (`drafts_pay`), or nothing has been seen,
    every call verifies. Where they do not, the verified program would run NTP's forwards and
    probes only, and its bookkeeping would make it the slower: calls run NTP's program, and
    every `call_gap`-th call runs verified again (rows whose drafts pay are found by its
    probes; what its checks accept moves the prior), the gap doubling up to MAX_CALL_GAP while
    drafts still do not pay."""
    if not self.learned or drafts_pay(self.by_position(max(widths)), cost_K, widths):
      self.ntp_calls, self.call_gap = 0, FIRST_CALL_GAP
      return True
    if self.ntp_calls < self.call_gap:
      self.ntp_calls += 1
      return False
    self.ntp_calls, self.call_gap = 0, min(2 * self.call_gap, MAX_CALL_GAP)
    return True

  def add(self, tried_P, rejected_P) -> None:
    """Counts of finished rows by block position: the draft tokens they tried, and rejected
    (`Acceptance.tried_in_block_BP`, `rejected_in_block_BP`)."""
    tried_P, rejected_P = np.asarray(tried_P, np.float64), np.asarray(rejected_P, np.float64)
    p = max(len(self.tried), len(tried_P))
    grow = lambda x: np.pad(x, (0, p - len(x)))  # noqa: E731
    self.tried = grow(self.tried) + grow(tried_P)
    self.rejected = grow(self.rejected) + grow(rejected_P)
    total = float(self.tried.sum())
    if total > PRIOR_HORIZON:
      scale = PRIOR_HORIZON / total
      self.tried, self.rejected = self.tried * scale, self.rejected * scale
