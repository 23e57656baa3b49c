"""Choosing tokens from logits: the mask token is never a candidate; greedy or temperature.

Dimension letters (docs/dimensions.md): B batch, T positions, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.decode.state import DecodeState


def pick(logits_BTV: jax.Array, st: DecodeState, s: SamplerSettings):
  """Mask logit -> -inf (before anything else), then (tokens [B, T], logp [B, T, V]). With a
  temperature, row b draws with fold_in(st.key_B[b], its NFE so far): one fresh key per forward
  the row counts. Greedy decoding draws nothing (no threefry hash per forward)."""
  # A select over the vocabulary fuses into the consumers below. `.at[..., mask_id].set` is a
  # scatter: XLA wrote the f32 logits out for it at every forward (on TPU, 2-layer llama8b on
  # v5p-8: 1.3 % of the decode's bytes), and XLA:CPU copied them twice first.
  is_mask_V = jnp.arange(logits_BTV.shape[-1]) == s.mask_id
  logits = jnp.where(is_mask_V, -jnp.inf, logits_BTV.astype(jnp.float32))
  if s.temperature > 0:
    logits = logits / s.temperature
    keys_B = jax.vmap(jax.random.fold_in)(st.key_B, st.nfe_B)
    tokens = jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys_B, logits)
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
