"""Building blocks: parameters with logical axes, RMSNorm, RoPE, SwiGLU, embedding.

Every parameter is an `nnx.Param` whose `out_sharding` metadata holds *logical* axis names
(e.g. ("embed", "mlp")); `sbd_jax.sharding` maps them to mesh axes with one rules table.
Eager sharding is off: parameters are placed by a jitted initializer or by Orbax restore.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from sbd_jax import sharding
from sbd_jax.model.architectures import ModelConfig, RopeScaling

Initializer = jax.nn.initializers.Initializer


def param(
  rngs: nnx.Rngs, init: Initializer, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...]
) -> nnx.Param:
  """A parameter annotated with logical axis names, one per dimension."""
  if len(axes) != len(shape):
    raise ValueError(f"{len(axes)} logical axes {axes} for a {len(shape)}-d shape {shape}")
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, computed in fp32."""

  def __init__(self, dim: int, eps: float, dtype, *, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, jax.nn.initializers.ones, (dim,), dtype, ("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(
  head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
  """[H/2] inverse frequencies, with optional Llama-3 ("llama3") frequency scaling.

  llama3 scaling keeps high frequencies (wavelength below original_context /
  high_freq_factor), divides low frequencies (wavelength above original_context /
  low_freq_factor) by `factor`, and interpolates linearly in 1/wavelength between.
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None:
    return inv_freq
  wavelength = 2 * math.pi / inv_freq
  context = scaling.original_max_position
  smooth = (context / wavelength - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  return jnp.where(
    wavelength < context / scaling.high_freq_factor,
    inv_freq,
    jnp.where(
      wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, interpolated
    ),
  )


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half RoPE (the Hugging Face layout: pairs are (i, i + H/2))."""
  angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
  sin, cos = jnp.sin(angles_BTh)[:, :, None], jnp.cos(angles_BTh)[:, :, None]
  x32 = x_BTNH.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BTNH.dtype)


def _gate_up(x_BTD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array):
  """(x @ gate, x @ up) [B, T, F] each, by plain autodiff."""
  return jnp.einsum("BTD,DF->BTF", x_BTD, gate_DF), jnp.einsum("BTD,DF->BTF", x_BTD, up_DF)


@jax.custom_vjp
def _gate_up_transposed_input(x_BTD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array):
  """`_gate_up` whose weight gradients are x^T @ dy with x^T [D, B*T] copied once.

  Left to itself, XLA:CPU computes those weight gradients by transposing the [B*T, F] output
  gradients inside the SwiGLU backward's elementwise fusion, which then walks memory across
  rows. Transposing the input instead moves D / F of the bytes, in one plain copy, once for
  both weights. The optimisation barrier keeps XLA from folding that copy back into the dots.
  A CPU workaround: the trainer turns it on for CPU meshes only
  (`mlp_weight_grads_from_transposed_input`)."""
  return _gate_up(x_BTD, gate_DF, up_DF)


def _gate_up_fwd(x_BTD, gate_DF, up_DF):
  return _gate_up(x_BTD, gate_DF, up_DF), (x_BTD, gate_DF, up_DF)


def _gate_up_bwd(residuals, grads):
  x_BTD, gate_DF, up_DF = residuals
  d_gate_BTF, d_up_BTF = grads
  dx_BTD = jnp.einsum("BTF,DF->BTD", d_gate_BTF, gate_DF)
  dx_BTD = dx_BTD + jnp.einsum("BTF,DF->BTD", d_up_BTF, up_DF)
  x_DN = jax.lax.optimization_barrier(x_BTD.reshape(-1, x_BTD.shape[-1]).T)
  flat_NF = lambda g: g.reshape(-1, g.shape[-1])  # noqa: E731
  return dx_BTD, x_DN @ flat_NF(d_gate_BTF), x_DN @ flat_NF(d_up_BTF)


_gate_up_transposed_input.defvjp(_gate_up_fwd, _gate_up_bwd)


_TRANSPOSED_INPUT = contextvars.ContextVar("sbd_mlp_transposed_input", default=False)


@contextlib.contextmanager
def mlp_weight_grads_from_transposed_input(on: bool = True) -> Iterator[None]:
  """Within this context (at trace time), MLPs compute their gate/up weight gradients from one
  transposed copy of their input (`_gate_up_transposed_input`). Same values; a compute layout
  for one platform, chosen by whoever compiles the step, never part of the model's config."""
  token = _TRANSPOSED_INPUT.set(on)
  try:
    yield
  finally:
    _TRANSPOSED_INPUT.reset(token)


class MLP(nnx.Module):
  """SwiGLU: down(silu(x @ gate) * (x @ up))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(0.02)
    d, f, dtype = cfg.embed_dim, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
    self.compute_dtype = jnp.dtype(cfg.compute_dtype)
    self.gate_DF = param(rngs, init, (d, f), dtype, ("embed", "mlp"))
    self.up_DF = param(rngs, init, (d, f), dtype, ("embed", "mlp"))
    self.down_FD = param(rngs, init, (f, d), dtype, ("mlp", "embed"))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    cast = lambda p: p[...].astype(self.compute_dtype)  # noqa: E731
    gate_up = _gate_up_transposed_input if _TRANSPOSED_INPUT.get() else _gate_up
    gate_BTF, up_BTF = gate_up(x_BTD, cast(self.gate_DF), cast(self.up_DF))
    h_BTF = sharding.constrain(
      jax.nn.silu(gate_BTF) * up_BTF, ("act_batch", "act_length", "act_mlp")
    )
    return jnp.einsum("BTF,FD->BTD", h_BTF, cast(self.down_FD))


class Embedding(nnx.Module):
  """Token embedding; `attend` reuses the table as a tied output projection."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.compute_dtype = jnp.dtype(cfg.compute_dtype)
    self.table_VD = param(
      rngs,
      jax.nn.initializers.normal(0.02),
      (cfg.vocab_size, cfg.embed_dim),
      jnp.dtype(cfg.param_dtype),
      ("vocab", "embed"),
    )

  def __call__(self, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(self.table_VD[...], tokens_BT, axis=0).astype(self.compute_dtype)

  def attend(self, x_BTD: jax.Array) -> jax.Array:
    return jnp.einsum("BTD,VD->BTV", x_BTD, self.table_VD[...].astype(self.compute_dtype))
