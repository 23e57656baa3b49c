"""Which forward a verified decode runs next, chosen by expected tokens per second: NTP's
one-token forward, or a wide forward that checks each row's drafts and drafts a block of one of
a few widths (`SamplerSettings.draft_widths`). Tuning code: it decides how many forwards an
answer takes and of which kind, never the answer, which `verify` keeps NTP's whatever is chosen.

The model. A row's drafts are accepted token after token with probability q (a geometric run).
A wide forward of width D (2D tokens a row: the run it checks, at most D tokens, and a block of
D) that checks a full run of D - 1 drafts settles E(D) = 1 + q + ... + q^(D-1) tokens, NTP's own
included. Its block's drafts follow the run it checked, so where a draft is rejected (all are
accepted with probability a = q^(D-1)) they are discarded, and the next forward has nothing to
check: it settles one token and drafts again. A run of wide forwards thus settles
R(D) = (E(D) + 1 - a) / (2 - a) tokens a row per forward (`settled_per_forward`: a check, and
a redraft after each rejection); NTP's forward settles one. Kind k costs `Tuning.cost_K[k]` (0:
NTP's forward; k >= 1: the k-th width), measured on the device for the program's batch size
(`costs`). The batch runs the kind with the most tokens per unit of cost over its live verified
rows: Σ_b R_b(D) / cost(D) against n / cost(1). So a wide forward that costs several one-token
ones (a CPU, an accelerator at a large batch) needs long accepted runs, and where a few rows
want one the others must not cost more than they bring. Near a tie the kind running now stays (within STICK of the best). A live
row that does not verify makes every forward the whole block's.

Estimates. Each row counts its accepted draft tokens and its rejections (a run's first wrong
token); each token tried weighs its earlier counts down by DECAY. Its belief in q is
Beta(accepted + w q0, rejected + w (1 - q0)), where the prior q0 is what the model's earlier
rows accepted (`Prior`, kept on the host across decodes and requests), not optimism, weighing
w = PRIOR_WEIGHT tokens once it has learned from them (LAPLACE_WEIGHT at 1/2 before). R is
taken in expectation over the belief (`beta_moments`): where acceptance is high, R grows fast
with q, and q's mean alone would undervalue a row whose evidence is thin. With both, one early
rejection does not send a row of a model whose rows accept nearly everything to NTP's forwards;
its own evidence weighs up to about 1 / (1 - DECAY) = 10 tokens, more than the prior's.
NTP's one-token forward also checks the next token of a draft that a wide forward left, so those
drafts keep informing the estimate while the batch runs NTP's forwards.

Probes. A row whose estimate says NTP learns nothing more unless it drafts. While the batch runs
NTP's forwards, once a row has nothing left to check and its probe is due, the batch runs one
wide forward, if the batch would go wide were that row's drafts all accepted (else nothing the
probe could find would change the choice), at the width that would pay most then; the NTP
forwards after it check the drafts at no cost. A row's probe gap starts at FIRST_PROBE of its
forwards and doubles with every probe it takes part in; a wide forward its own estimate says
pays resets it, and a probe whose drafts are all accepted makes the next one due at once. No
probe comes sooner than `probe_floor` forwards after the row's start or its last wide forward:
what the probe costs beyond NTP's forward, over PROBE_SHARE, so probes never take more than
about a tenth of the time of the NTP forwards between them (on an accelerator at a small batch
the floor is below FIRST_PROBE; on a CPU, where a wide forward costs several one-token ones,
it is tens of forwards, and drafts would have to be accepted long to pay anyway). So drafts
that keep failing cost a row about log2(n / gap) wide forwards over n tokens (none where no
acceptance would make a wide forward pay), and drafts that start succeeding are found within a
gap and followed up at once.

Calls. Where a fresh row's drafts would not pay at the prior (`drafts_pay`), a verified program
would run NTP's forwards and probes only, at its bookkeeping's extra cost: `sampler` then runs
NTP's own program for most calls, and verified ones at doubling gaps (`Prior.verifies_next`).

Dimension letters (docs/dimensions.md): B batch, K forward kinds (NTP's, then one per width),
P block positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

DECAY = 0.9  # the weight of a row's earlier evidence at each draft token it tries
PRIOR_WEIGHT = 8.0  # the prior's weight, in draft tokens, once it has learned from earlier rows
LAPLACE_WEIGHT = 2.0  # its weight before: Laplace's q0 = 1/2, as one accepted and one rejected
FIRST_PROBE, MAX_PROBE_GAP = 4, 1024  # forwards between a row's probes: the first, the most
# Probes' extra time, at most, as a share of the NTP forwards around them: a probe follows at
# least (its extra cost in NTP forwards) / PROBE_SHARE forwards of its row (`probe_floor`).
PROBE_SHARE = 0.1
NTP = 0  # the kind of NTP's one-token forward; kind k >= 1 drafts `draft_widths[k - 1]`
# The kind running now stays while its tokens per unit of cost are within this share of the
# best kind's (`choose`): near a tie, estimates that wobble would otherwise switch the batch
# back and forth, and a switch costs what neither kind's table entry holds (NTP's forwards
# that check drafts one token at a time, the policy's work between them).
STICK = 0.05


@flax.struct.dataclass
class Tuning:
  """A verified decode's tuning, traced (one compilation serves any values)."""

  cost_K: jax.Array  # float32: the cost of each kind of forward, in any one unit
  prior: jax.Array  # float32 scalar: q0, the probability earlier rows' draft tokens were accepted
  # int32 scalar: -1 chooses each forward; k >= 0 runs kind k only, and no row ends at an EOS
  # (`costs`: a program timed at each kind)
  force: jax.Array
  # bool scalar: the prior comes from earlier rows' checks (else it is Laplace's, nothing seen)
  learned: jax.Array

  @classmethod
  def of(cls, cost_K, prior: float = 0.5, force: int = -1, learned: bool = False) -> "Tuning":
    """Host (numpy) leaves from host values: a compiled decode takes them as arguments, where
    device arrays made per call would cost a dispatch each (about 0.2 ms on a CPU host). JAX
    arrays (traced ones too) stay JAX arrays."""
    xp = jnp if any(isinstance(x, jax.Array) for x in (cost_K, prior, force, learned)) else np
    return cls(
      xp.asarray(cost_K, np.float32),
      xp.asarray(prior, np.float32),
      xp.asarray(force, np.int32),
      xp.asarray(learned, bool),
    )


@flax.struct.dataclass
class Estimates:
  """Per row: its evidence on its drafts, and when it next asks for a probe."""

  accepted_B: jax.Array  # float32: accepted draft tokens, decayed
  rejected_B: jax.Array  # float32: rejections, decayed
  probe_at_B: jax.Array  # int32: the row's NFE from which it asks for a probe
  probe_gap_B: jax.Array  # int32

  @classmethod
  def fresh(cls, rows: int) -> "Estimates":
    zeros_B = jnp.zeros((rows,), jnp.float32)
    first_B = jnp.full((rows,), FIRST_PROBE, jnp.int32)
    return cls(zeros_B, zeros_B, first_B, first_B)


def belief(est: Estimates, tuning: "Tuning") -> tuple[jax.Array, jax.Array]:
  """([B], [B]): each row's belief in q, Beta(alpha, beta): the prior's q0 as PRIOR_WEIGHT draft
  tokens (LAPLACE_WEIGHT before it learned), then its own accepted tokens and rejections
  (module docstring)."""
  w = jnp.where(tuning.learned, PRIOR_WEIGHT, LAPLACE_WEIGHT)
  return est.accepted_B + w * tuning.prior, est.rejected_B + w * (1 - tuning.prior)


def beta_moments(alpha, beta, n: int, xp=jnp):
  """[..., n]: E[q^j] for j < n, q ~ Beta(alpha, beta) [...]: the product over i < j of
  (alpha + i) / (alpha + beta + i)."""
  alpha, beta = xp.asarray(alpha, xp.float32)[..., None], xp.asarray(beta, xp.float32)[..., None]
  i = xp.arange(n - 1, dtype=xp.float32)
  ratio = (alpha + i) / (alpha + beta + i)
  ones = xp.ones(ratio.shape[:-1] + (1,), xp.float32)
  return xp.cumprod(xp.concatenate([ones, ratio], axis=-1), axis=-1)


def settled_per_forward(moments, widths: tuple[int, ...], xp=jnp):
  """[..., W]: tokens a row settles per forward in a run of wide forwards of each width D,
  R(D) = (E + 1 - a) / (2 - a): a check settles E = 1 + q + ... + q^(D-1) and accepts all D - 1
  drafts with probability a = q^(D-1), and after a rejection one forward settles one token and
  drafts again (module docstring). `moments` [..., P]: q^j for j < P, or their expectations
  over a belief in q (`beta_moments`: with E and a in expectation, an uncertain q
  counts the long runs it may give, where q's mean alone would undervalue them). `xp`: jnp, or
  np on the host (`drafts_pay`)."""
  index_W = np.asarray(widths) - 1
  run_W = xp.cumsum(moments, axis=-1)[..., index_W]
  all_W = moments[..., index_W]
  return (run_W + 1 - all_W) / (2 - all_W)


def expected_settled(moments_BP, widths: tuple[int, ...], room_B: jax.Array) -> jax.Array:
  """[B, W]: tokens a row settles per wide forward of each width (`settled_per_forward`), at
  most the row's `room_B` tokens left."""
  settled_BW = settled_per_forward(moments_BP, widths)
  return jnp.minimum(settled_BW, room_B[:, None].astype(jnp.float32))


def _values(st, live_B: jax.Array, widths: tuple[int, ...], sure_B: jax.Array | None = None):
  """(tokens per unit of cost of each kind [K], per row whether a wide forward at the best width
  pays for itself [B], that kind). `sure_B`: rows counted as if every draft were accepted."""
  t = st.tuning
  room_B = jnp.maximum(st.limit_B - st.verified_B, 1)
  moments_BP = beta_moments(*belief(st.estimates, t), max(widths))
  if sure_B is not None:
    moments_BP = jnp.where(sure_B[:, None], 1.0, moments_BP)
  settled_BW = expected_settled(moments_BP, widths, room_B)
  ntp = jnp.sum(live_B).astype(jnp.float32)
  wide_W = jnp.sum(jnp.where(live_B[:, None], settled_BW, 0.0), axis=0)
  value_K = jnp.concatenate([ntp[None], wide_W]) / t.cost_K
  best_wide = jnp.argmax(value_K[1:]) + 1
  pays_B = jnp.take(settled_BW, best_wide - 1, axis=1) / t.cost_K[best_wide] > 1 / t.cost_K[NTP]
  return value_K, pays_B, best_wide


def choose(st, active_B: jax.Array, s) -> jax.Array:
  """The kind of the next forward (module docstring), an int32 scalar: NTP (0) or a width's
  (k >= 1): the kind with the most tokens per unit of cost, unless the kind running now (none
  before the first choice) is within STICK of it. A probe where the batch would run NTP's forward, some row's probe is due, and the
  batch would go wide if those rows' drafts were all accepted (else nothing a probe finds could
  change the choice), at the width that would pay most then. The whole block's while a live
  row does not verify; `Tuning.force` if >= 0."""
  widths = s.draft_widths
  live_B = active_B & ~st.done_B
  checked_B = live_B & st.verify_B
  value_K, _, _ = _values(st, checked_B, widths)
  best = jnp.argmax(value_K).astype(jnp.int32)
  stays = (st.kind >= 0) & (value_K[st.kind] >= (1 - STICK) * value_K[best])
  by_value = jnp.where(stays, st.kind, best)
  due_B = _probe_due(st, checked_B, widths)
  hopeful_K, _, probe = _values(st, checked_B, widths, sure_B=due_B)
  worth_it = jnp.any(due_B) & (hopeful_K[probe] > hopeful_K[NTP])
  kind = jnp.where((by_value == NTP) & worth_it, probe, by_value)
  kind = jnp.where(jnp.any(live_B & ~st.verify_B), len(widths), kind)
  return jnp.where(st.tuning.force >= 0, st.tuning.force, kind).astype(jnp.int32)


def prefill_drafts(st, active_B: jax.Array, s) -> jax.Array:
  """bool scalar: whether a verified prefill drafts block 0 (`prefill`): where the batch would
  go wide now (`choose`), or, while the prior has learned nothing, where it would were the
  drafts all accepted: a prefill's drafts are the cheapest probe, P positions after the
  prompt."""
  kind = choose(st, active_B, s)
  checked_B = active_B & ~st.done_B & st.verify_B
  hopeful_K, _, best = _values(st, checked_B, s.draft_widths, sure_B=checked_B)
  could_pay = jnp.any(checked_B) & (hopeful_K[best] > hopeful_K[NTP])
  chosen = (kind != NTP) | (~st.tuning.learned & could_pay)
  return jnp.where(st.tuning.force >= 0, kind != NTP, chosen)


def probe_floor(tuning: Tuning, widths: tuple[int, ...]) -> jax.Array:
  """int32 scalar: the forwards a row runs before a probe, at least (module docstring): what
  the probe costs beyond NTP's forward, in NTP's forwards, over PROBE_SHARE. The probe's width
  is the one that settles most per unit of cost were its drafts all accepted. Where a wide
  forward costs little more than NTP's (an accelerator at a small batch) this is below
  FIRST_PROBE; where it costs several (a CPU, a large batch), drafts have to be accepted
  longer to pay, and probing more often could not find much."""
  cost_K = tuning.cost_K / tuning.cost_K[NTP]
  best = jnp.argmax(jnp.asarray(widths, jnp.float32) / cost_K[1:]) + 1
  return jnp.ceil((cost_K[best] - 1.0) / PROBE_SHARE).astype(jnp.int32)


def _probe_at(st, widths: tuple[int, ...]) -> jax.Array:
  """[B] int32: the NFE from which each row's probe is due: its schedule's, and never before
  `probe_floor` forwards from its start (its prefill drafted a block, as a probe would, or
  did not, where drafts would not pay: `prefill_drafts`)."""
  return jnp.maximum(st.estimates.probe_at_B, probe_floor(st.tuning, widths))


def _probe_due(st, checked_B: jax.Array, widths: tuple[int, ...]) -> jax.Array:
  """[B]: rows whose probe is due and that have no draft left to check."""
  pending_B = st.index > st.verified_B
  return checked_B & (st.nfe_B >= _probe_at(st, widths)) & ~pending_B


def unchanged_for(st, active_B: jax.Array, s) -> jax.Array:
  """int32 scalar: NTP forwards the batch can run before `choose` could choose otherwise, 0
  unless it chose NTP's now. Until then no estimate moves (no row has a draft left to check),
  no row ends (the caller watches that), and no row's probe falls due; each forward only leaves
  a row less room, which makes a wide forward worth less. So the loop runs them without choosing
  (`loop`)."""
  live_B = active_B & ~st.done_B
  checked_B = live_B & st.verify_B
  pending = jnp.any(checked_B & (st.index > st.verified_B))
  probe_at_B = _probe_at(st, s.draft_widths)
  waiting_B = checked_B & (st.nfe_B < probe_at_B)  # probes not yet due
  never = jnp.int32(MAX_PROBE_GAP + 1)  # a bound on the loop's length, no more
  until = jnp.min(jnp.where(waiting_B, probe_at_B - st.nfe_B, never))
  until = jnp.where(st.tuning.force >= 0, never, until)
  ntp = (st.kind == NTP) & ~pending & ~jnp.any(live_B & ~st.verify_B)
  return jnp.where(ntp, until, 0).astype(jnp.int32)


def drafting(st, active_B: jax.Array, s) -> "Estimates":
  """The rows' probe schedule after a wide forward (every row drafts in it): a row that would
  have asked for it by value starts its gap again; one whose probe was due doubles its gap;
  every row's next probe is a gap away."""
  est = st.estimates
  checked_B = active_B & ~st.done_B & st.verify_B
  _, pays_B, _ = _values(st, checked_B, s.draft_widths)
  doubled_B = jnp.minimum(2 * est.probe_gap_B, MAX_PROBE_GAP)
  gap_B = jnp.where(_probe_due(st, checked_B, s.draft_widths), doubled_B, est.probe_gap_B)
  gap_B = jnp.where(checked_B, jnp.where(pays_B, FIRST_PROBE, gap_B), est.probe_gap_B)
  wait_B = jnp.maximum(gap_B, probe_floor(st.tuning, s.draft_widths))
  probe_at_B = jnp.where(checked_B, st.nfe_B + wait_B, est.probe_at_B)
  return est.replace(probe_at_B=probe_at_B, probe_gap_B=gap_B)


def observe(st, drafted_BT: jax.Array, accepted_BT: jax.Array) -> Estimates:
  """The estimates after a check of [B, T] drafted tokens, of which `accepted_BT` were accepted
  (a prefix; `st` is the state after the check): each token tried (the accepted ones, and the
  first wrong one) weighs a row's earlier evidence down by DECAY. A row whose check by NTP's
  forward accepted the last of its drafts (a probe's, all accepted) is due for another probe at
  once: its drafts may have turned good, and one probe says little."""
  est = st.estimates
  accepted_B = jnp.sum(accepted_BT, axis=-1).astype(jnp.float32)
  rejected_B = jnp.any(drafted_BT & ~accepted_BT, axis=-1).astype(jnp.float32)
  fade_B = DECAY ** (accepted_B + rejected_B)
  est = est.replace(
    accepted_B=fade_B * est.accepted_B + accepted_B,
    rejected_B=fade_B * est.rejected_B + rejected_B,
  )
  if drafted_BT.shape[-1] > 1:  # a wide forward's check
    return est
  all_good_B = (accepted_B > 0) & (st.index <= st.verified_B)
  return est.replace(probe_at_B=jnp.where(all_good_B, st.nfe_B, est.probe_at_B))


# A row whose checks accept more than half a block on average drafts only the positions it
# predicts with more than this probability (`sure_enough`).
SURE = 0.9


def sure_enough(st, logp_BPV: jax.Array, open_BP: jax.Array) -> jax.Array:
  """[B, P] bool: the open positions a row drafting its whole block (`SamplerSettings.draft`
  "all") drafts under `adaptive`: all of them, but where its checks so far accepted more than
  P / 2 drafted tokens on average, only the first and those predicted with probability above
  SURE. A rejected draft costs the forward after it its block; where checks accept long runs
  that is a long run's worth of tokens, and an unsure position is the likely rejection
  (BENCHMARKS.md: on the paper's recipe 7 % faster; where checks accept short runs, drafting
  every position is). The first open position is always drafted: a row that drafts nothing
  learns nothing of its drafts."""
  p = logp_BPV.shape[1]
  a = st.acceptance
  long_runs_B = 2 * a.accepted_B > p * a.drafts_B
  sure_BP = jnp.max(logp_BPV, axis=-1) > jnp.log(SURE)
  position_P = jnp.arange(p)
  first_B = jnp.min(jnp.where(open_BP, position_P, p), axis=-1)
  first_BP = position_P == first_B[:, None]
  return open_BP & (~long_runs_B[:, None] | sure_BP | first_BP)


# The prior's memory, in draft tokens: older counts are scaled down past it, so the prior
# follows what the model's recent rows accepted.
PRIOR_HORIZON = 4096.0


# Calls run as NTP's own program between two verified ones, where drafts do not pay at the
# prior (`Prior.verifies_next`): the first gap, and the longest.
FIRST_CALL_GAP, MAX_CALL_GAP = 2, 64


def drafts_pay(q: float, cost_K, widths: tuple[int, ...]) -> bool:
  """Whether a fresh row at a learned prior `q` settles more per unit of cost in a wide forward
  of some width than in NTP's (`_values`, for one row)."""
  cost_K = np.asarray(cost_K, np.float32)
  moments = beta_moments(PRIOR_WEIGHT * q, PRIOR_WEIGHT * (1 - q), max(widths), xp=np)
  settled_W = settled_per_forward(moments, widths, xp=np)
  return bool(np.max(settled_W / cost_K[1:]) > 1.0 / cost_K[NTP])


@dataclasses.dataclass
class Prior:
  """What a model's earlier verified rows accepted (host side): the q0 that new rows' estimates
  start from. Laplace's rule of succession with nothing seen: 0.5. And, where drafts do not pay
  at q0, when a call next runs verified (`verifies_next`)."""

  accepted: float = 0.0
  rejected: float = 0.0
  ntp_calls: int = 0  # calls run as NTP's own program since the last verified one
  call_gap: int = FIRST_CALL_GAP  # such calls before the next verified one

  @property
  def value(self) -> float:
    return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

  @property
  def learned(self) -> bool:
    """Whether any checked draft has been counted (`Tuning.learned`)."""
    return self.accepted + self.rejected > 0

  def verifies_next(self, cost_K, widths: tuple[int, ...]) -> bool:
    """Whether the next call of a decode that chooses its forwards runs its verified program,
    else NTP's own, whose text it equals (TensorRT-LLM likewise turns speculation off when
    acceptance drops). Where drafts pay at the prior (`drafts_pay`), or nothing has been seen,
    every call verifies. Where they do not, the verified program would run NTP's forwards and
    probes only, and its bookkeeping would make it the slower: calls run NTP's program, and
    every `call_gap`-th call runs verified again (rows whose drafts pay are found by its
    probes; what its checks accept moves the prior), the gap doubling up to MAX_CALL_GAP while
    drafts still do not pay."""
    if not self.learned or drafts_pay(self.value, cost_K, widths):
      self.ntp_calls, self.call_gap = 0, FIRST_CALL_GAP
      return True
    if self.ntp_calls < self.call_gap:
      self.ntp_calls += 1
      return False
    self.ntp_calls, self.call_gap = 0, min(2 * self.call_gap, MAX_CALL_GAP)
    return True

  def add(self, accepted: float, rejected: float) -> None:
    """Counts of finished rows: their accepted draft tokens and their rejections."""
    self.accepted += float(accepted)
    self.rejected += float(rejected)
    total = self.accepted + self.rejected
    if total > PRIOR_HORIZON:
      scale = PRIOR_HORIZON / total
      self.accepted, self.rejected = self.accepted * scale, self.rejected * scale
