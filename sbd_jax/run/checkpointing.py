"""Orbax checkpoints: train state + data iterator in one step, and params-only exports.

They live in a workdir (layout in `sbd_jax.run.workdir`): checkpoints/<step>/ holds {state: train
state, data_iter: Grain iterator state}; params/ the latest params-only export. Restores always
target an abstract, sharded state, so arrays land directly on their devices.
"""

from __future__ import annotations

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from sbd_jax import paths
from sbd_jax.model import layer_layout

CHECKPOINTS_DIR = "checkpoints"
PARAMS_DIR = "params"


def make_manager(
  workdir: str, every_steps: int, keep: int, async_save: bool = True
) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    save_interval_steps=every_steps,
    enable_async_checkpointing=async_save,
    create=True,
  )
  return ocp.CheckpointManager(
    paths.resolve(workdir) / CHECKPOINTS_DIR,
    options=options,
    item_names=("state", "data_iter"),
  )


def save(
  manager: ocp.CheckpointManager,
  step: int,
  state: nnx.State,
  data_iter: grain.DatasetIterator,
  *,
  force: bool = False,
) -> bool:
  args = ocp.args.Composite(
    state=ocp.args.StandardSave(nnx.to_pure_dict(state)),
    data_iter=grain.checkpoint.CheckpointSave(data_iter),
  )
  return manager.save(step, args=args, force=force)


def restore(
  manager: ocp.CheckpointManager,
  step: int,
  abstract_state: nnx.State,
  data_iter: grain.DatasetIterator,
) -> nnx.State:
  """Restore step `step` into the (abstract, sharded) structure; `data_iter` is updated in place."""
  target = nnx.to_pure_dict(abstract_state)
  restored = manager.restore(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target),
      data_iter=grain.checkpoint.CheckpointRestore(data_iter),
    ),
  )
  state = jax.tree.map(lambda x: x, abstract_state)  # a copy whose leaves we replace
  nnx.replace_by_pure_dict(state, restored["state"])
  return state


def export_params(workdir: str, params: nnx.State) -> str:
  """Write a params-only checkpoint (no optimizer state) to <workdir>/params."""
  path = paths.resolve(workdir) / PARAMS_DIR
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, nnx.to_pure_dict(params), force=True)
  return str(path)


def load_params(path: str, abstract_params: nnx.State) -> nnx.State:
  """Load a params-only checkpoint into the abstract (sharded) params structure.

  The checkpoint may hold the layers in the other layout (unrolled vs stacked for scan); it is
  then restored in its own layout and converted, each array ending with the target sharding.
  """
  path = paths.resolve(path)
  if not path.is_dir():
    raise FileNotFoundError(f"no params checkpoint at {path}")
  target = nnx.to_pure_dict(abstract_params)
  with ocp.StandardCheckpointer() as checkpointer:
    stored = checkpointer.metadata(path).item_metadata.tree
    stacked = layer_layout.is_stacked(target)
    if layer_layout.is_stacked(stored) == stacked:
      restored = checkpointer.restore(path, target)
    else:
      restored = checkpointer.restore(path, layer_layout.convert(target, not stacked))
      restored = jax.tree.map(
        lambda x, t: jax.device_put(x, t.sharding) if getattr(t, "sharding", None) else x,
        layer_layout.convert(restored, stacked),
        target,
      )
  params = jax.tree.map(lambda x: x, abstract_params)
  nnx.replace_by_pure_dict(params, restored)
  return params
