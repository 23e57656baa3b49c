"""Model: preset parameter counts (abstractly), KV cache consistency, remat, RoPE scaling."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.model import architectures, layers
from sbd_jax.model.architectures import RopeScaling
from sbd_jax.model.kv_cache import KVCache
from sbd_jax.model.layers import rope_inverse_frequencies
from sbd_jax.model.transformer import Transformer, count_params


@pytest.mark.parametrize(
  "preset, expected_billions",
  [
    (architectures.llama3_1_8b, 8.030),
    (architectures.qwen3_8b, 8.191),
    (architectures.ablation_3b, 3.213),
    (architectures.llama3_2_1b, 1.236),  # meta-llama/Llama-3.2-1B: 1,235,814,400
  ],
)
def test_presets_have_published_parameter_counts_without_allocating(preset, expected_billions):
  cfg = preset()
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
  assert count_params(abstract) / 1e9 == pytest.approx(expected_billions, abs=0.001)


def test_every_parameter_carries_one_logical_axis_per_dimension():
  model = nnx.eval_shape(
    lambda: Transformer(architectures.qwen3_8b(num_layers=1), rngs=nnx.Rngs(0))
  )
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = var.get_metadata().get("out_sharding")
    assert axes is not None and len(axes) == len(var.shape), path


def small_cfg(**overrides):
  return architectures.tiny(
    num_layers=2,
    embed_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    mlp_dim=48,
    attention_chunk=8,
    **overrides,
  )


def _cached_pieces(model, tokens, meta, cache, per_row_end: bool):
  """Logits of `tokens` fed to the cache in three pieces, and the final cache. With
  `per_row_end`, the cache offset is [B] (each row written at its own offset: a scatter)."""
  forward = nnx.jit(lambda model, *args: model(*args))
  if per_row_end:
    cache = cache.replace(end=jnp.zeros(tokens.shape[:1], jnp.int32))
  pieces = []
  for lo, hi in [(0, 5), (5, 6), (6, 13)]:
    logits, cache = forward(
      model, tokens[:, lo:hi], jax.tree.map(lambda x: x[:, lo:hi], meta), cache
    )
    cache = cache.replace(end=cache.end + (hi - lo))
    pieces.append(logits)
  return jnp.concatenate(pieces, axis=1), cache


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("per_row_end", [False, True])
def test_cached_prefill_plus_decode_equals_one_full_forward(heads_first, per_row_end):
  cfg = small_cfg(qk_norm=True, tie_embeddings=False)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, cfg.vocab_size)
  positions = jnp.tile(jnp.arange(13), (2, 1))
  meta = TokenMeta.causal(jnp.ones((2, 13), jnp.int32), positions)
  full, _ = nnx.jit(lambda model, *args: model(*args))(model, tokens, meta)
  cache = KVCache.empty(cfg, 2, 20, heads_first=heads_first)
  logits, cache = _cached_pieces(model, tokens, meta, cache, per_row_end)
  np.testing.assert_allclose(logits, full, atol=1e-5)
  if heads_first:  # the same keys and values as a slots-first cache, heads before slots
    assert cache.k[0].shape == (2, cfg.num_kv_heads, 20, cfg.head_dim)
    _, slots_first = _cached_pieces(model, tokens, meta, KVCache.empty(cfg, 2, 20), per_row_end)
    for a, b in zip(cache.k + cache.v, slots_first.k + slots_first.v):
      np.testing.assert_array_equal(a, b.swapaxes(1, 2))


def test_remat_and_dense_attention_give_identical_outputs_and_grads():
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, 256)
  meta = TokenMeta.causal(jnp.ones((2, 10), jnp.int32), jnp.tile(jnp.arange(10), (2, 1)))

  @nnx.jit
  def value_and_grad(model):
    return nnx.value_and_grad(lambda m: jnp.mean(m(tokens, meta)[0] ** 2))(model)

  def loss_and_grads(cfg):
    return value_and_grad(Transformer(cfg, rngs=nnx.Rngs(3)))

  base_loss, base_grads = loss_and_grads(small_cfg())
  for variant in (small_cfg(remat="full"), small_cfg(attention_impl="dense")):
    loss, grads = loss_and_grads(variant)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, base_grads)


@pytest.mark.parametrize(
  "layout",
  [{}, pytest.param({"scan_layers": True, "remat": "full"}, marks=pytest.mark.integration)],
)
def test_mlp_weight_grads_from_transposed_input_equal_autodiff(layout):
  """`layers.mlp_weight_grads_from_transposed_input` (the CPU train step's custom VJP) changes
  how the gate/up weight gradients are computed, not what they are: every gradient equals plain
  autodiff's."""
  tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, 256)
  meta = TokenMeta.causal(jnp.ones((3, 12), jnp.int32), jnp.tile(jnp.arange(12), (3, 1)))

  def mean_sin(model):
    return jnp.mean(jnp.sin(model(tokens, meta)[0]))

  def value_and_grad(on: bool):
    model = Transformer(small_cfg(**layout), rngs=nnx.Rngs(5))
    graphdef, state = nnx.split(model)
    with layers.mlp_weight_grads_from_transposed_input(on):
      traced = str(jax.make_jaxpr(lambda s: mean_sin(nnx.merge(graphdef, s)))(state))
      assert ("name=_gate_up_transposed_input" in traced) == on  # each side takes its path
      return nnx.jit(nnx.value_and_grad(mean_sin))(model)

  (loss, grads), (want_loss, want_grads) = value_and_grad(True), value_and_grad(False)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, want_grads
  )
  gate_grads = [g for path, g in nnx.to_flat_state(grads) if "gate_DF" in map(str, path)]
  assert gate_grads and all(float(jnp.abs(g[...]).max()) > 1e-4 for g in gate_grads)


def test_llama3_rope_scaling_against_the_piecewise_definition():
  scaling = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
  )
  scaled = np.asarray(rope_inverse_frequencies(128, 500_000.0, scaling))
  plain = 1.0 / 500_000.0 ** (np.arange(0, 128, 2) / 128)
  for f, s in zip(plain, scaled):
    wavelength = 2 * math.pi / f
    if wavelength < 8192 / 4:
      expected = f
    elif wavelength > 8192 / 1:
      expected = f / 8
    else:
      smooth = (8192 / wavelength - 1) / (4 - 1)
      expected = (1 - smooth) * f / 8 + smooth * f
    assert s == pytest.approx(expected, rel=1e-5)
  assert scaled[0] == pytest.approx(plain[0]) and scaled[-1] == pytest.approx(plain[-1] / 8)


def test_invalid_model_configs_fail_with_clear_errors():
  with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
    architectures.tiny(num_heads=3, num_kv_heads=2)
