"""The two layouts of a model's layers in a parameter tree, and conversion between them.

Unrolled (`scan_layers=False`): `blocks/<i>/attention/q_DNH` [D, N, H], one subtree per layer.
Stacked (`scan_layers=True`): `blocks/attention/q_DNH` [num_layers, D, N, H], run by lax.scan.

Checkpoints keep the layout of the run that wrote them; `checkpointing.load_params` converts
when a run loads params of the other layout (e.g. an 8B config, which scans, starting from a
converted Hugging Face model, which is saved unrolled).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

BLOCKS = "blocks"


def is_stacked(tree: Mapping[str, Any]) -> bool:
  """True for the stacked layout (its `blocks` keys are module names, not layer indices)."""
  keys = list(tree[BLOCKS].keys())
  return not all(isinstance(k, int) or str(k).isdigit() for k in keys)


def _layer_keys(blocks: Mapping) -> list:
  return sorted(blocks, key=int)


def _row_sharding(sharding):
  """The sharding of one layer of a stacked array (the layer axis is never sharded)."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
  return sharding


def _stacked_sharding(sharding):
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
  return sharding


def stack(tree: dict) -> dict:
  """Unrolled -> stacked. Leaves may be arrays or ShapeDtypeStructs."""

  def one(*layers):
    first = layers[0]
    if isinstance(first, jax.ShapeDtypeStruct):
      sharding = _stacked_sharding(getattr(first, "sharding", None))
      return jax.ShapeDtypeStruct((len(layers), *first.shape), first.dtype, sharding=sharding)
    return jnp.stack(layers)

  blocks = tree[BLOCKS]
  return {**tree, BLOCKS: jax.tree.map(one, *(blocks[k] for k in _layer_keys(blocks)))}


def unstack(tree: dict) -> dict:
  """Stacked -> unrolled (integer layer keys, as `nnx.to_pure_dict` writes them)."""
  blocks = tree[BLOCKS]
  num_layers = jax.tree.leaves(blocks)[0].shape[0]

  def row(x, i):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(
        x.shape[1:], x.dtype, sharding=_row_sharding(getattr(x, "sharding", None))
      )
    return x[i]

  layers = {i: jax.tree.map(lambda x, i=i: row(x, i), blocks) for i in range(num_layers)}
  return {**tree, BLOCKS: layers}


def convert(tree: dict, stacked: bool) -> dict:
  """`tree` in the requested layout (returned as is when it already is)."""
  if is_stacked(tree) == stacked:
    return tree
  return stack(tree) if stacked else unstack(tree)
