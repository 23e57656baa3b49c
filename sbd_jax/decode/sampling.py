"""Choosing tokens from logits: the mask token is never a candidate; greedy or temperature.

Two ways to draw with a temperature. `pick` (plain SBD) draws fresh noise at every forward a
row counts. `pick_at` draws the token of response slot r with noise fixed by (the row's key, r)
(the Gumbel-max form of sampling: argmax of logits / T plus Gumbel noise): NTP's samples, and
verified SBD's drafts and checks, so that a draft of slot r and NTP's draw there share their
noise (`decode.verify`).

Dimension letters (docs/dimensions.md): B batch, T positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState


def scaled_logits(logits_BTV: jax.Array, s: SamplerSettings) -> jax.Array:
  """float32 logits with the mask token's at -inf, divided by the temperature if any."""
  # A select over the vocabulary fuses into the consumers. `.at[..., mask_id].set` is a
  # scatter: XLA wrote the f32 logits out for it at every forward (on TPU, 2-layer llama8b on
  # v5p-8: 1.3 % of the decode's bytes), and XLA:CPU copied them twice first.
  is_mask_V = jnp.arange(logits_BTV.shape[-1]) == s.mask_id
  logits = jnp.where(is_mask_V, -jnp.inf, logits_BTV.astype(jnp.float32))
  return logits / s.temperature if s.temperature > 0 else logits


def pick(logits_BTV: jax.Array, st: DecodeState, s: SamplerSettings):
  """(tokens [B, T], logp [B, T, V]). With a temperature, row b draws with fold_in(st.key_B[b],
  its NFE so far): one fresh key per forward the row counts. Greedy decoding draws nothing (no
  threefry hash per forward)."""
  logits = scaled_logits(logits_BTV, s)
  if s.temperature > 0:
    keys_B = jax.vmap(jax.random.fold_in)(st.key_B, st.nfe_B)
    tokens = jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys_B, logits)
  else:
    tokens = argmax(logits)
  return tokens.astype(jnp.int32), jax.nn.log_softmax(logits, axis=-1)


def pick_at(logits_BTV: jax.Array, key_B: jax.Array, slot_BT: jax.Array, s: SamplerSettings):
  """(tokens [B, T], logp [B, T, V]) for the response slots `slot_BT`: with a temperature,
  slot r of row b draws with fold_in(key_B[b], r), whichever forward computes its logits."""
  logits = scaled_logits(logits_BTV, s)
  if s.temperature > 0:

    def draw(key, slot, x_V):
      return jax.random.categorical(jax.random.fold_in(key, slot), x_V)

    per_slot = jax.vmap(draw, in_axes=(None, 0, 0))  # the slots of one row
    tokens = jax.vmap(per_slot)(key_B, slot_BT, logits)
  else:
    tokens = argmax(logits)
  return tokens.astype(jnp.int32), jax.nn.log_softmax(logits, axis=-1)


def argmax(x_BTV: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis (the first index of the maximum) as two plain reductions.
  argmax lowers to one (value, index) reduction, which XLA's CPU backend does not vectorise;
  a max and a min over the vocabulary are each a vectorised reduction. NaN logits give the
  last id (argmax: the first NaN's)."""
  v = x_BTV.shape[-1]
  top = jnp.max(x_BTV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(x_BTV == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(first, v - 1)
