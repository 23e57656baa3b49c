"""An SBD training forward on 2 x 16384 tokens never materialises an O(L^2) array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbd_jax.model import architectures
from sbd_jax.model.transformer import Transformer
from sbd_jax.sbd.objective import ObjectiveConfig, loss_fn

SEQ_LEN = 16_384  # the SBD input is 2L = 32768 tokens


def compiled_forward(impl):
  cfg = architectures.tiny(
    num_layers=1,
    embed_dim=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    attention_impl=impl,
    attention_chunk=512,
  )
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  shape = jax.ShapeDtypeStruct((1, SEQ_LEN), jnp.int32)
  batch = {"tokens": shape, "segment_ids": shape, "positions": shape, "loss_mask": shape}

  def forward(state, batch, rng):
    return loss_fn(nnx.merge(graphdef, state), batch, rng, ObjectiveConfig(mask_id=259))[0]

  return cfg, jax.jit(forward).lower(state, batch, jax.random.key(0)).compile()


@pytest.mark.integration  # compiles 2 x 16384 tokens
def test_sbd_forward_on_2x16384_tokens_has_no_quadratic_buffer():
  score_matrix_bytes = (2 * SEQ_LEN) ** 2 * 4  # one fp32 [2L, 2L] matrix: 4 GiB
  cfg, chunked = compiled_forward("chunked")
  temp = chunked.memory_analysis().temp_size_in_bytes
  assert temp < score_matrix_bytes / 32, f"{temp / 2**20:.0f} MiB of temporaries"

  # The dense reference compiles (never runs) to show the bound would catch a quadratic buffer.
  _, dense = compiled_forward("dense")
  assert dense.memory_analysis().temp_size_in_bytes > score_matrix_bytes / 2

  # And it runs: a real forward over 32768 tokens with finite loss.
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  batch = {
    "tokens": jnp.asarray(rng.integers(0, 256, (1, SEQ_LEN)), jnp.int32),
    "segment_ids": jnp.ones((1, SEQ_LEN), jnp.int32),
    "positions": jnp.arange(SEQ_LEN, dtype=jnp.int32)[None],
    "loss_mask": jnp.ones((1, SEQ_LEN), jnp.int32),
  }
  loss = chunked(nnx.state(model), batch, jax.random.key(0))
  assert np.isfinite(float(loss))
