"""Choosing tokens from logits: the mask token is never a candidate; greedy or temperature.

A decode whose settings sample (`temperature` > 0) reads each row's temperature from the state
(`DecodeState.temperature_B`, traced: one compilation serves every temperature); a row at 0
takes the argmax, so greedy and sampled rows share a batch. When no row samples, no noise is
drawn (`lax.cond`). A greedy decode (`temperature` = 0) draws nothing.

Two ways to draw with a temperature. `pick` (plain SBD) draws fresh noise at every forward a
row counts. `pick_at` draws the token of response slot r with noise fixed by (the row's key, r)
(the Gumbel-max form of sampling: argmax of logits / T plus Gumbel noise): NTP's samples, and
verified SBD's drafts and checks, so that a draft of slot r and NTP's draw there share their
noise (`decode.verify`). `pick_rows` gives each row of a block the one its verification calls
for.

Dimension letters (docs/dimensions.md): B batch, T positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState


def scaled_logits(logits_BTV: jax.Array, s: SamplerSettings, temperature_B: jax.Array):
  """float32 logits with the mask token's at -inf; a sampled decode's divided by each row's
  temperature (by 1 in rows at 0, whose argmax is the greedy token)."""
  # A select over the vocabulary fuses into the consumers. `.at[..., mask_id].set` is a
  # scatter: XLA wrote the f32 logits out for it at every forward (on TPU, 2-layer llama8b on
  # v5p-8: 1.3 % of the decode's bytes), and XLA:CPU copied them twice first.
  is_mask_V = jnp.arange(logits_BTV.shape[-1]) == s.mask_id
  logits = jnp.where(is_mask_V, -jnp.inf, logits_BTV.astype(jnp.float32))
  if s.temperature > 0:
    return logits / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None, None]
  return logits


def _choose(logits_BTV, temperature_B, s: SamplerSettings, draw: Callable[[], jax.Array]):
  """Tokens [B, T]: `draw()` in rows with a temperature, the argmax in the others."""
  if s.temperature <= 0:
    return argmax(logits_BTV)
  sampled_B = temperature_B > 0
  return jax.lax.cond(
    jnp.any(sampled_B),
    lambda: jnp.where(sampled_B[:, None], draw(), argmax(logits_BTV)),
    lambda: argmax(logits_BTV),
  )


def _fresh_draw(logits_BTV: jax.Array, st: DecodeState) -> jax.Array:
  """Row b draws with fold_in(st.key_B[b], its NFE so far): one fresh key per forward."""
  keys_B = jax.vmap(jax.random.fold_in)(st.key_B, st.nfe_B)
  return jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys_B, logits_BTV)


def _slot_draw(logits_BTV: jax.Array, st: DecodeState, slot_BT: jax.Array) -> jax.Array:
  """Slot r of row b draws with fold_in(st.key_B[b], r), whichever forward computes it."""

  def one(key, slot, x_V):
    return jax.random.categorical(jax.random.fold_in(key, slot), x_V)

  per_slot = jax.vmap(one, in_axes=(None, 0, 0))  # the slots of one row
  return jax.vmap(per_slot)(st.key_B, slot_BT, logits_BTV)


def _picked(
  logits_BTV, st: DecodeState, s: SamplerSettings, draw: Callable[[jax.Array], jax.Array]
):
  logits = scaled_logits(logits_BTV, s, st.temperature_B)
  tokens = _choose(logits, st.temperature_B, s, lambda: draw(logits))
  return tokens.astype(jnp.int32), jax.nn.log_softmax(logits, axis=-1)


def pick(logits_BTV: jax.Array, st: DecodeState, s: SamplerSettings):
  """(tokens [B, T], logp [B, T, V]). With a temperature, row b draws with fold_in(st.key_B[b],
  its NFE so far): one fresh key per forward the row counts."""
  return _picked(logits_BTV, st, s, lambda x: _fresh_draw(x, st))


def pick_at(logits_BTV: jax.Array, st: DecodeState, slot_BT: jax.Array, s: SamplerSettings):
  """(tokens [B, T], logp [B, T, V]) for the response slots `slot_BT`: with a temperature,
  slot r of row b draws with fold_in(st.key_B[b], r), whichever forward computes its logits."""
  return _picked(logits_BTV, st, s, lambda x: _slot_draw(x, st, slot_BT))


def pick_rows(logits_BTV: jax.Array, st: DecodeState, slot_BT: jax.Array, s: SamplerSettings):
  """An SBD block's draws: `pick_at` in rows that verify (`DecodeState.verify_B`), `pick` in the
  others. Each kind of noise is drawn only while a row of that kind samples."""
  if not s.verified:
    return pick(logits_BTV, st, s)
  sampled_B = st.temperature_B > 0

  def draw(x):
    def only_if(rows_B, draw_fn):
      return jax.lax.cond(
        jnp.any(rows_B & sampled_B), draw_fn, lambda: jnp.zeros(x.shape[:2], jnp.int32)
      )

    slot = only_if(st.verify_B, lambda: _slot_draw(x, st, slot_BT).astype(jnp.int32))
    fresh = only_if(~st.verify_B, lambda: _fresh_draw(x, st).astype(jnp.int32))
    return jnp.where(st.verify_B[:, None], slot, fresh)

  return _picked(logits_BTV, st, s, draw)


def noise(scaled_BTV: jax.Array, st: DecodeState, slot_BT: jax.Array, s: SamplerSettings):
  """[B, T, V] float32: the Gumbel noise each row's draw adds to its scaled logits (the draw is
  the argmax of the sum, as `jax.random.categorical` takes it): slot-keyed in rows that verify
  (`pick_at`), fresh per forward in the others (`pick`), 0 in rows at temperature 0 and in a
  greedy decode. A constrained draw masks the logits and adds the same noise, so an allowed
  token wins where it would have won unmasked."""
  zeros = jnp.zeros(scaled_BTV.shape, jnp.float32)
  if s.temperature <= 0:
    return zeros
  b, t, v = scaled_BTV.shape

  def slot_noise():
    keys_BT = jax.vmap(lambda k, s_T: jax.vmap(lambda r: jax.random.fold_in(k, r))(s_T))(
      st.key_B, slot_BT
    )
    return jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (v,))))(keys_BT)

  def fresh_noise():
    keys_B = jax.vmap(jax.random.fold_in)(st.key_B, st.nfe_B)
    return jax.vmap(lambda k: jax.random.gumbel(k, (t, v)))(keys_B)

  sampled_B = st.temperature_B > 0
  verify_B = st.verify_B if s.verified else jnp.zeros((b,), bool)
  slot = jax.lax.cond(jnp.any(sampled_B & verify_B), slot_noise, lambda: zeros)
  fresh = jax.lax.cond(jnp.any(sampled_B & ~verify_B), fresh_noise, lambda: zeros)
  return jnp.where(sampled_B[:, None, None], jnp.where(verify_B[:, None, None], slot, fresh), 0.0)


def chosen_logprob(logp_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """[B, T] float32: each chosen token's log-probability."""
  return jnp.take_along_axis(logp_BTV, tokens_BT[..., None], axis=-1)[..., 0]


def argmax(x_BTV: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis (the first index of the maximum) as two plain reductions.
  argmax lowers to one (value, index) reduction, which XLA's CPU backend does not vectorise;
  a max and a min over the vocabulary are each a vectorised reduction. NaN logits give the
  last id (argmax: the first NaN's)."""
  v = x_BTV.shape[-1]
  top = jnp.max(x_BTV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(x_BTV == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(first, v - 1)
