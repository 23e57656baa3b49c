"""The optimizer: which parameters weight decay shrinks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax.model.architectures import tiny
from sbd_jax.model.transformer import Transformer
from sbd_jax.training.optim import make_optimizer


@pytest.mark.parametrize(
  "decay_embeddings", [pytest.param(True, marks=pytest.mark.integration), False]
)
def test_weight_decay_shrinks_matrices_and_the_embedding_table_only_when_asked(decay_embeddings):
  params = nnx.state(Transformer(tiny(num_layers=1), rngs=nnx.Rngs(params=0)), nnx.Param)
  optim = config_lib.base_config().optim
  optim.warmup_steps, optim.decay_embeddings = 0, decay_embeddings
  tx, schedule = make_optimizer(optim, total_steps=10)
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  # With zero gradients, AdamW's update is decay alone: p <- p (1 - lr wd) where it applies.
  shrink = 1 - schedule(0) * optim.weight_decay
  decay_miss, kept = {}, {}  # per parameter: max |new - p (1 - lr wd)|; unchanged at all
  for (path, before), after in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(new)
  ):
    before, after = np.asarray(before), np.asarray(after)
    key = jax.tree_util.keystr(path)
    decay_miss[key] = float(np.max(np.abs(after - before * shrink)))
    kept[key] = bool(np.array_equal(before, after))
  table = next(k for k in kept if "table_VD" in k)
  assert kept[table] == (not decay_embeddings)
  if decay_embeddings:
    assert decay_miss[table] < 1e-7
  for key in kept:
    if "scale" in key:  # RMSNorm scales: never decayed
      assert kept[key], key
    elif "table_VD" not in key:  # every other matrix: decayed
      assert decay_miss[key] < 1e-7 and not kept[key], key
