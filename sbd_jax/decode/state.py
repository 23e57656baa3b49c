"""The decode loop's carry and where each row's tokens sit.

Layout. Prompts are left-padded to a bucket of Q slots, so the prompt ends at slot Q in every
row: pad slots get segment 0 (invisible), real tokens segment 1 with positions 0, 1, ... from
the first real token. Generated token r has position prompt_len + r and response slot r; the
cache holds a row's response slots [0, commit) after its prompt, in order.

Where an SBD row stands, in response slots:

    [0, commit)        in the KV cache (as a causal forward of them would leave it)
    [commit, index)    decided, not yet in the cache: the previous block, written by the next
                       (wide) forward; verified, the draft that forward checks
    [index, index+P)   the block being decoded; masked where not yet revealed
    [0, verified)      verified decoding: tokens equal to NTP's own

Dimension letters (docs/dimensions.md): B batch, Q prompt slots, R response slots, P block
positions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.decode.acceptance import Acceptance
from sbd_jax.decode.policy import Estimates, Tuning
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.model.kv_cache import KVCache


@flax.struct.dataclass
class DecodeState:
  """Loop carry. `index` is the first response slot of each row's current block [B] (SBD;
  equal across rows in lockstep), or the next token slot (NTP: a scalar, or one per row)."""

  tokens_BR: jax.Array  # generated tokens; mask_id where not (yet) revealed
  # float32: each revealed token's log-probability in the distribution it was chosen from (with
  # the row's temperature); verified rows: NTP's, once verification has checked it. Kept only
  # when the settings ask (`SamplerSettings.logprobs`); 0 otherwise
  logprob_BR: jax.Array
  reveal_step_BR: jax.Array  # the sequence's forward index (1-based) that revealed each token
  nfe_B: jax.Array  # forwards counted per sequence
  length_B: jax.Array  # generated tokens kept (incl. EOS); valid once done
  limit_B: jax.Array  # int32: tokens the row may generate (max_new_tokens, or a request's own)
  done_B: jax.Array
  index: jax.Array  # int32, [B] (SBD) or scalar (NTP)
  commit_B: jax.Array  # int32: response slots in the cache (SBD; < index: the next pass is wide)
  verified_B: jax.Array  # int32: leading response slots equal to NTP's tokens (verify)
  rollbacks_B: jax.Array  # int32: drafts rejected by verification
  acceptance: Acceptance  # verified rows' drafts and accepted tokens
  estimates: Estimates  # verified rows: their evidence on their drafts (`policy`)
  tuning: Tuning  # verified decodes: the costs, prior and forcing the forwards are chosen by
  kind: jax.Array  # int32 scalar: the kind of the next forward (`policy.choose`); -1 before any
  # int32 scalar: the EOS id rows end at; -1 (none) in a program timed at one kind of forward
  # (`policy.Tuning.force`)
  eos_id: jax.Array
  # Constrained decodes (`decode.constrained`): each row's automaton state after its settled
  # tokens (int32; 0 = unconstrained), the tokens it settled at a state that allowed one token
  # only (int32), and the table set of every row's automaton (None where nothing is constrained)
  cstate_B: jax.Array
  forced_B: jax.Array
  ctables: Any
  forwards: jax.Array  # int32 scalar: forwards the batch has run, the prefill included
  wide_forwards: jax.Array  # int32 scalar: of those, 2P-token forwards after the prefill
  ntp_forwards: jax.Array  # int32 scalar: of those, verified SBD's NTP one-token forwards
  # int32 [K]: forwards after the prefill by kind (`policy`): NTP's one-token forwards (verified
  # SBD's), then the wide forwards of each draft width (`SamplerSettings.draft_widths`)
  kind_forwards_K: jax.Array
  cache: KVCache
  key_B: jax.Array  # typed PRNG key per row: its prompt's (`prompt_keys`)
  # float32 per row: its sampling temperature, read by a sampled decode (settings.temperature
  # > 0); 0 = argmax in that row (`sampling`). A traced value: one compilation serves all.
  temperature_B: jax.Array
  # bool per row: the row's drafts are checked against NTP (`verify`). False in every row of a
  # program that cannot verify (`SamplerSettings.verified` off); in one that can, each row's
  # own (a traced value: plain and verified rows share a program and a batch).
  verify_B: jax.Array


class RowLayout(NamedTuple):
  """Where each row's tokens sit: its prompt length and its generated tokens' positions."""

  prompt_len_B: jax.Array  # int32 [B]
  gen_pos_BR: jax.Array  # int32 [B, R]: prompt_len + r

  @classmethod
  def of(cls, prompt_len_B: jax.Array, response_slots: int) -> "RowLayout":
    return cls(prompt_len_B, prompt_len_B[:, None] + jnp.arange(response_slots, dtype=jnp.int32))


def prompt_meta(prompt_len_B: jax.Array, bucket: int) -> tuple[jax.Array, jax.Array]:
  """(segment ids, positions) [B, Q] of left-padded prompts: pad slots get segment 0."""
  slot_Q = jnp.arange(bucket, dtype=jnp.int32)
  first_real_B = bucket - prompt_len_B
  seg_BQ = (slot_Q >= first_real_B[:, None]).astype(jnp.int32)
  return seg_BQ, jnp.maximum(slot_Q - first_real_B[:, None], 0) * seg_BQ


def initial_state(
  s: SamplerSettings,
  cache: KVCache,
  key_B: jax.Array,
  done_B: jax.Array,
  row_index: bool,
  temperature=0.0,
  verify=True,
  tuning: Tuning | None = None,
  ctables=None,
  cstate=0,
) -> DecodeState:
  """Nothing decoded yet. `row_index`: a block (SBD) or token slot (NTP) index per row, else one
  NTP slot for the batch. `temperature`: every row's, or one per row [B]; `verify` likewise,
  where the settings can verify. `tuning`: how a verified decode chooses its forwards (default:
  every kind costs the same, `default_tuning`). `ctables`, `cstate`: a constrained decode's
  tables and every row's (or each row's [B]) initial automaton state."""
  b, r = done_B.shape[0], s.response_slots
  tuning = default_tuning(s) if tuning is None else tuning
  return DecodeState(
    tokens_BR=jnp.full((b, r), s.mask_id, jnp.int32),
    logprob_BR=jnp.zeros((b, r), jnp.float32),
    reveal_step_BR=jnp.zeros((b, r), jnp.int32),
    nfe_B=jnp.zeros((b,), jnp.int32),
    length_B=jnp.zeros((b,), jnp.int32),
    limit_B=jnp.full((b,), s.max_new_tokens, jnp.int32),
    done_B=done_B,
    index=jnp.zeros((b,) if row_index else (), jnp.int32),
    commit_B=jnp.zeros((b,), jnp.int32),
    verified_B=jnp.zeros((b,), jnp.int32),
    rollbacks_B=jnp.zeros((b,), jnp.int32),
    acceptance=Acceptance.zeros(b, s.block_size),
    estimates=Estimates.fresh(b),
    tuning=tuning,
    kind=jnp.full((), -1, jnp.int32),  # none chosen yet
    eos_id=jnp.where(tuning.force >= 0, -1, s.eos_id).astype(jnp.int32),
    cstate_B=jnp.broadcast_to(jnp.asarray(cstate, jnp.int32), (b,)),
    forced_B=jnp.zeros((b,), jnp.int32),
    ctables=ctables,
    forwards=jnp.zeros((), jnp.int32),
    wide_forwards=jnp.zeros((), jnp.int32),
    ntp_forwards=jnp.zeros((), jnp.int32),
    kind_forwards_K=jnp.zeros((1 + len(s.draft_widths),), jnp.int32),
    cache=cache,
    key_B=key_B,
    temperature_B=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
    verify_B=jnp.broadcast_to(jnp.asarray(verify, bool) & s.verified, (b,)),
  )


def default_tuning(s: SamplerSettings) -> Tuning:
  """Forwards of every kind at one cost, and no prior knowledge of the drafts."""
  return Tuning.of(np.ones((1 + len(s.draft_widths),), np.float32), block_size=s.block_size)


def prompt_keys(seed: jax.Array, prompt_B: jax.Array) -> jax.Array:
  """Each prompt's PRNG key, fold_in(key(seed), its index among the prompts decoded): a
  prompt's samples then depend on the seed and the prompt alone, not on its batch or queue."""
  return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), prompt_B)


def row_slices(x_BR: jax.Array, start_B: jax.Array, size: int, alone: bool) -> jax.Array:
  """x[b, start_B[b] : start_B[b] + size] for every row [B, size] (starts clamped into range).
  Rows that do not move alone share one start, read as one dynamic slice."""
  if not alone:
    return jax.lax.dynamic_slice_in_dim(x_BR, start_B[0], size, axis=1)
  return jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, size))(x_BR, start_B)


def scatter_slots(x_BR: jax.Array, slot_BP: jax.Array, new_BP: jax.Array, write_BP: jax.Array):
  """x with x[b, slot_BP[b, p]] = new_BP[b, p] where `write_BP`; slots past the row's end are
  dropped (never clamped onto other slots)."""
  rows_B1 = jnp.arange(x_BR.shape[0])[:, None]
  slot_BP = jnp.where(write_BP, slot_BP, x_BR.shape[1])
  return x_BR.at[rows_B1, slot_BP].set(new_BP, mode="drop")


def row_updates(x_BR: jax.Array, new_BP: jax.Array, start_B: jax.Array, alone: bool):
  """x with x[b, start_B[b] : start_B[b] + P] = new_BP[b] (the inverse of `row_slices`)."""
  if not alone:
    return jax.lax.dynamic_update_slice_in_dim(x_BR, new_BP, start_B[0], axis=1)
  update = lambda x, new, s: jax.lax.dynamic_update_slice_in_dim(x, new, s, axis=0)  # noqa: E731
  return jax.vmap(update)(x_BR, new_BP, start_B)
