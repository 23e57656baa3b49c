"""Scanned layers (`scan_layers`): the same function as the unrolled model, in every use.

The reference is the unrolled model with the same weights, restacked by `layer_layout.stack`:
training-layout logits and gradients under each remat policy, KV-cached decoding, and params
checkpoints loaded across the two layouts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbd_jax import sharding
from sbd_jax.attention.meta import TokenMeta
from sbd_jax.hf.importer import abstract_params
from sbd_jax.model import architectures, layer_layout
from sbd_jax.model.architectures import REMAT_CHOICES
from sbd_jax.model.kv_cache import KVCache
from sbd_jax.model.transformer import Transformer
from sbd_jax.run import checkpointing
from sbd_jax.sbd import masks

B, L = 2, 24


def cfg_of(**overrides):
  return architectures.tiny(num_layers=3, vocab_size=64, **overrides)


def params_of(model) -> dict:
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def scanned_copy(unrolled: Transformer, **overrides) -> Transformer:
  """A scanned model holding `unrolled`'s weights (its own random init is overwritten)."""
  model = Transformer(unrolled.cfg.replace(scan_layers=True, **overrides), rngs=nnx.Rngs(99))
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, layer_layout.stack(params_of(unrolled)))
  nnx.update(model, state)
  return model


def sbd_inputs(block_size=5):
  """Two packed rows (two documents in the first) in the 2L SBD training layout."""
  rng = np.random.RandomState(0)
  segments = np.ones((B, L), np.int32)
  segments[0, 14:] = 2
  positions = np.concatenate([np.arange(14), np.arange(L - 14)])[None].repeat(B, 0)
  positions[1] = np.arange(L)
  meta = masks.sbd_training_meta(
    jnp.asarray(segments), jnp.asarray(positions), block_size, max_block_size=8
  )
  tokens = jnp.asarray(rng.randint(0, 64, (B, 2 * L)), jnp.int32)
  return tokens, meta


def loss_and_grads(model, tokens, meta):
  def loss(m):
    logits = m(tokens, meta)[0]
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

  return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)


def test_stacked_parameters_carry_the_layers_axis():
  model = nnx.eval_shape(lambda: Transformer(cfg_of(scan_layers=True), rngs=nnx.Rngs(0)))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    axes = var.get_metadata()["out_sharding"]
    if path[0] == "blocks":
      assert axes[0] == "layers" and var.shape[0] == 3, path
    assert len(axes) == len(var.shape), path


@pytest.mark.parametrize("remat", REMAT_CHOICES[:3])  # dots_no_batch: a policy like dots
def test_scanned_equals_unrolled_logits_and_gradients(remat):
  tokens, meta = sbd_inputs()
  unrolled = Transformer(cfg_of(attention_impl="dense"), rngs=nnx.Rngs(0))
  scanned = scanned_copy(unrolled, remat=remat)
  loss_u, grads_u = loss_and_grads(unrolled, tokens, meta)
  loss_s, grads_s = loss_and_grads(scanned, tokens, meta)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  expected = layer_layout.stack(nnx.to_pure_dict(grads_u))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4),
    nnx.to_pure_dict(grads_s),
    expected,
  )
  logits_u = unrolled(tokens, meta)[0]
  np.testing.assert_allclose(scanned(tokens, meta)[0], logits_u, atol=1e-5, rtol=0)


def test_scanned_kv_cached_decoding_equals_uncached_forward():
  """Prefill, then a masked block on the cache: the same logits as one uncached forward."""
  unrolled = Transformer(cfg_of(), rngs=nnx.Rngs(1))
  scanned = scanned_copy(unrolled)
  tokens = jax.random.randint(jax.random.key(2), (B, 13), 0, 64)
  meta = TokenMeta.causal(jnp.ones((B, 13), jnp.int32), jnp.tile(jnp.arange(13), (B, 1)))
  full, _ = scanned(tokens, meta)
  np.testing.assert_allclose(full, unrolled(tokens, meta)[0], atol=1e-5, rtol=0)
  forward = nnx.jit(lambda model, *args: model(*args))
  cache = KVCache.empty(scanned.cfg, B, 20)
  pieces = []
  for lo, hi in [(0, 6), (6, 7), (7, 13)]:
    logits, cache = forward(
      scanned, tokens[:, lo:hi], jax.tree.map(lambda x: x[:, lo:hi], meta), cache
    )
    cache = cache.replace(end=cache.end + (hi - lo))
    pieces.append(logits)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("saved_scanned", [False, True])
def test_params_checkpoint_loads_into_either_layout(tmp_path, saved_scanned):
  unrolled = Transformer(cfg_of(), rngs=nnx.Rngs(4))
  saved = scanned_copy(unrolled) if saved_scanned else unrolled
  path = checkpointing.export_params(str(tmp_path), nnx.state(saved, nnx.Param))
  mesh = sharding.make_mesh((1, -1, 1))
  for scan in (False, True):
    abstract = abstract_params(cfg_of(scan_layers=scan), mesh)
    loaded = nnx.to_pure_dict(checkpointing.load_params(path, abstract))
    assert layer_layout.is_stacked(loaded) == scan
    expected = layer_layout.convert(params_of(unrolled), scan)
    jax.tree.map(np.testing.assert_array_equal, loaded, expected)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(nnx.to_pure_dict(abstract))):
      assert got.sharding == want.sharding


def test_layout_conversion_round_trips_and_keeps_sharding_specs():
  mesh = sharding.make_mesh((1, -1, 1))
  unrolled = nnx.to_pure_dict(abstract_params(cfg_of(), mesh))
  stacked = layer_layout.stack(unrolled)
  direct = nnx.to_pure_dict(abstract_params(cfg_of(scan_layers=True), mesh))
  describe = lambda x: (x.shape, x.dtype, x.sharding)  # noqa: E731
  assert jax.tree.map(describe, stacked) == jax.tree.map(describe, direct)
  back = layer_layout.unstack(stacked)
  assert jax.tree.structure(back) == jax.tree.structure(unrolled)
  assert layer_layout.convert(stacked, True) is stacked


@pytest.mark.integration  # compiles long sequences
def test_scanned_training_step_memory_stays_linear_in_the_sequence():
  """XLA must not hoist the attention masks of every chunk pair out of the layer loop (they
  are [2L, 2L]-sized): on the CPU compiler, the scanned, rematerialised gradient's temporaries
  grow about linearly with L and stay below the unrolled model's."""

  def temporaries(seq: int, scan: bool) -> int:
    meta = masks.sbd_training_meta(
      jnp.ones((1, seq), jnp.int32), jnp.arange(seq)[None], 8, max_block_size=16
    )
    cfg = cfg_of(scan_layers=scan, remat="full", attention_chunk=256)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    def loss(state, tokens):
      return jnp.mean(nnx.merge(graphdef, state)(tokens, meta)[0])

    tokens = jax.ShapeDtypeStruct((1, 2 * seq), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  short, long = temporaries(512, True), temporaries(1024, True)
  assert long < 2.5 * short, (short, long)  # a [2L, 2L] term would make it ~4x
  assert long < temporaries(1024, False), long
