"""Which forward a verified decode runs next, chosen by expected tokens per second: NTP's
one-token forward, or a wide forward that checks each row's drafts and drafts a block of one of
a few widths (`SamplerSettings.draft_widths`). Tuning code: it decides how many forwards an
answer takes and of which kind, never the answer, which `verify` keeps NTP's whatever is chosen.

The model. A row's drafts are accepted token after token, the draft at block position j with
probability q_j given that those before it were (position 0, a block's first token, is NTP's
own). A wide forward of width D (2D tokens a row: the run it checks, at most D tokens, and a
block of D) that checks a full run of D - 1 drafts settles E(D) = S_0 + S_1 + ... + S_(D-1)
tokens, NTP's own included, where S_j = q_1 ... q_j (S_0 = 1). Its block's drafts follow the run
it checked, so where a draft is rejected (all are accepted with probability a = S_(D-1)) they
are discarded, and the next forward has nothing to check: it settles one token and drafts again.
A run of wide forwards thus settles R(D) = (E(D) + 1 - a) / (2 - a) tokens a row per forward
(`settled_per_forward`: a check, and a redraft after each rejection); NTP's forward settles one.
Kind k costs `Tuning.cost_K[k]` (0: NTP's forward; k >= 1: the k-th width), measured on the
device for the program's batch size (`costs`). The batch runs the kind with the most tokens per
unit of cost over its live verified rows: Σ_b R_b(D) / cost(D) against n / cost(1). So a wide
forward that costs several one-token ones (a CPU, an accelerator at a large batch) needs long
accepted runs, and where a few rows want one the others must not cost more than they bring. Near
a tie the kind running now stays (within STICK of the best). A live row that does not verify
makes every forward the whole block's.

Estimates. Drafts deeper in a block are accepted less often, by an amount that differs between
models, and a row's drafts may be better or worse than its model's: proportional hazards with a
Gamma frailty. The draft at position j is accepted with probability q_j = q0_j^λ, where q0_j is
what the model's earlier rows accepted there (`acceptance_prior.Prior`, kept on the host across
decodes and requests; 1/2 before anything is seen), not optimism, and λ is the row's own (below
1: better drafts than its model's). A row's belief in λ is Gamma(w h + rejected, w h +
exposure): its rejections (a run's first wrong token), and its exposure, the hazard -log q0_j of
each token it tried (half of it for a rejected one, the actuarial rule, which keeps a constant
q's estimate nearly unbiased); each token tried weighs its earlier evidence down by DECAY. The
prior, λ = 1, weighs w = PRIOR_WEIGHT tokens at the mean hazard h once it has learned
(LAPLACE_WEIGHT before). S_j is taken in expectation over the belief: (rate / (rate +
H_j))^shape, H_j = -log(q0_1 ... q0_j) the prior's cumulative hazard (`survival`). Where
acceptance is high, R grows fast with it, and a point estimate would undervalue a row whose
evidence is thin. So one early rejection does not send a row of a model whose rows accept nearly
everything to NTP's forwards (its own evidence weighs up to about 1 / (1 - DECAY) = 10 tokens,
more than the prior's), and a width is valued by what the model's deeper drafts are worth, not
by its first ones'. Within a decode the shape over positions is the prior's: what the rows learn
of it joins the prior when they finish.
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

Calls. Where a fresh row's drafts would not pay at the prior, `sampler` runs NTP's own program
for most calls (`acceptance_prior.Prior.verifies_next`).

Dimension letters (docs/dimensions.md): B batch, K forward kinds (NTP's, then one per width),
P block positions, V vocabulary.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

DECAY = 0.9  # the weight of a row's earlier evidence at each draft token it tries
PRIOR_WEIGHT = 8.0  # the prior's weight, in draft tokens, once it has learned from earlier rows
LAPLACE_WEIGHT = 2.0  # its weight before: Laplace's q0 = 1/2, as one accepted and one rejected
# The smallest and largest acceptance a position's prior may hold (its hazard stays finite).
Q_MIN, Q_MAX = 1e-4, 1.0 - 1e-6
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
  # float32 [P]: q0 by block position, the share of earlier rows' draft tokens there that were
  # accepted (given those before them were); 1 at position 0, a block's NTP token
  # (`acceptance_prior.Prior`)
  prior_P: jax.Array
  # int32 scalar: -1 chooses each forward; k >= 0 runs kind k only, and no row ends at an EOS
  # (`costs`: a program timed at each kind)
  force: jax.Array
  # bool scalar: the prior comes from earlier rows' checks (else it is Laplace's, nothing seen)
  learned: jax.Array
  # bool scalar: every draft is checked as wrong, so each forward settles one token of NTP's
  # (the text stays NTP's): a timed call's forwards are its tokens, whatever the drafts (`costs`)
  reject: jax.Array

  @classmethod
  def of(
    cls, cost_K, prior=0.5, force=-1, learned=False, *, block_size: int, reject=False
  ) -> "Tuning":
    """Host (numpy) leaves from host values: a compiled decode takes them as arguments, where
    device arrays made per call would cost a dispatch each (about 0.2 ms on a CPU host). JAX
    arrays (traced ones too) stay JAX arrays. `prior`: q0 at every position, or by position
    [P]."""
    leaves = (cost_K, prior, force, learned, reject)
    xp = jnp if any(isinstance(x, jax.Array) for x in leaves) else np
    position_P = np.arange(block_size)
    prior_P = xp.where(position_P == 0, 1.0, xp.asarray(prior, np.float32)).astype(np.float32)
    return cls(
      xp.asarray(cost_K, np.float32),
      prior_P,
      xp.asarray(force, np.int32),
      xp.asarray(learned, bool),
      xp.asarray(reject, bool),
    )


@flax.struct.dataclass
class Estimates:
  """Per row: its evidence on its drafts, where its next checked draft sits, and when it next
  asks for a probe."""

  exposure_B: jax.Array  # float32: the prior's hazard of the draft tokens tried, decayed
  rejected_B: jax.Array  # float32: rejections, decayed
  next_at_B: jax.Array  # int32: the block position of the next draft token a check tries
  probe_at_B: jax.Array  # int32: the row's NFE from which it asks for a probe
  probe_gap_B: jax.Array  # int32

  @classmethod
  def fresh(cls, rows: int) -> "Estimates":
    zeros_B = jnp.zeros((rows,), jnp.float32)
    first_B = jnp.full((rows,), FIRST_PROBE, jnp.int32)
    return cls(zeros_B, zeros_B, jnp.ones((rows,), jnp.int32), first_B, first_B)


def hazards(prior_P, xp=jnp):
  """[P]: -log q0_j, each block position's hazard under the prior (0 at position 0)."""
  return -xp.log(xp.clip(xp.asarray(prior_P, xp.float32), Q_MIN, Q_MAX)) * (
    xp.arange(len(prior_P)) > 0
  )


def prior_belief(hazard_P, learned, xp=jnp):
  """The prior's Gamma(shape, rate) over λ: mean 1, as w tokens at the mean hazard of the
  draft positions (w: PRIOR_WEIGHT once learned, else LAPLACE_WEIGHT)."""
  w = xp.where(learned, PRIOR_WEIGHT, LAPLACE_WEIGHT)
  weight = w * xp.mean(hazard_P[1:])
  return weight, weight


def belief(est: Estimates, tuning: "Tuning") -> tuple[jax.Array, jax.Array]:
  """([B], [B]): each row's belief in its λ, Gamma(shape, rate): the prior's (`prior_belief`),
  then its own rejections and exposure (module docstring)."""
  shape, rate = prior_belief(hazards(tuning.prior_P), tuning.learned)
  return shape + est.rejected_B, rate + est.exposure_B


def survival(shape, rate, hazard_P, n: int, xp=jnp):
  """[..., n]: E[S_j] for j < n, the probability that a check from block position 1 accepts
  the drafts at positions 1 .. j, over λ ~ Gamma(shape, rate) [...]: S_j = exp(-λ H_j), H_j
  the prior's cumulative hazard, whose expectation is (rate / (rate + H_j))^shape."""
  shape, rate = xp.asarray(shape, xp.float32)[..., None], xp.asarray(rate, xp.float32)[..., None]
  cumulative_n = xp.cumsum(xp.asarray(hazard_P, xp.float32)[:n])
  return xp.exp(-shape * xp.log1p(cumulative_n / xp.maximum(rate, 1e-30)))


def settled_per_forward(moments, widths: tuple[int, ...], xp=jnp):
  """[..., W]: tokens a row settles per forward in a run of wide forwards of each width D,
  R(D) = (E + 1 - a) / (2 - a): a check settles E = 1 + q + ... + q^(D-1) and accepts all D - 1
  drafts with probability a = q^(D-1), and after a rejection one forward settles one token and
  drafts again (module docstring). `moments` [..., P]: S_j for j < P, or their expectations
  over a belief (`survival`: with E and a in expectation, an uncertain acceptance counts the
  long runs it may give, where a point estimate would undervalue them). `xp`: jnp, or np on the
  host (`drafts_pay`)."""
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
  moments_BP = survival(*belief(st.estimates, t), hazards(t.prior_P), max(widths))
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
  (a prefix; `st` is the state after the check, its estimates before it): each token tried (the
  accepted ones, and the first wrong one) adds its position's hazard to the row's exposure (half
  of it for a wrong one) and weighs the row's earlier evidence down by DECAY. After a wide
  forward's check the next draft to check is its block's first (position 1); after NTP's, the
  one after the token it checked. A row whose check by NTP's forward accepted the last of its
  drafts (a probe's, all accepted) is due for another probe at once: its drafts may have turned
  good, and one probe says little."""
  est = st.estimates
  t_T = jnp.arange(drafted_BT.shape[-1])
  accepted_B = jnp.sum(accepted_BT, axis=-1).astype(jnp.float32)
  wrong_BT = drafted_BT & (t_T == accepted_B[:, None])  # the first wrong token
  hazard_P = hazards(st.tuning.prior_P)
  position_BT = jnp.minimum(est.next_at_B[:, None] + t_T, len(hazard_P) - 1)
  weight_BT = accepted_BT.astype(jnp.float32) + 0.5 * wrong_BT.astype(jnp.float32)
  rejected_B = jnp.any(wrong_BT, axis=-1).astype(jnp.float32)
  fade_B = DECAY ** (accepted_B + rejected_B)
  wide = drafted_BT.shape[-1] > 1  # a wide forward's check
  est = est.replace(
    exposure_B=fade_B * est.exposure_B + jnp.sum(weight_BT * hazard_P[position_BT], axis=-1),
    rejected_B=fade_B * est.rejected_B + rejected_B,
    next_at_B=jnp.ones_like(est.next_at_B) if wide else est.next_at_B + 1,
  )
  if wide:
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
