"""The train state, abstract first: shapes and shardings before any array exists, then a jitted
initializer (or a restore) that creates it already sharded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax import sharding
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.model.transformer import Transformer


class TrainState(nnx.Module):
  """The model and its optimizer: everything a checkpoint must hold besides the data cursor."""

  def __init__(self, model: Transformer, tx: optax.GradientTransformation):
    self.model = model
    self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


@dataclasses.dataclass
class StateSpec:
  """How the train state is built and laid out, before any array exists."""

  graphdef: Any
  abstract: nnx.State  # ShapeDtypeStructs carrying their NamedShardings
  shardings: nnx.State  # NamedSharding per leaf
  init: Callable[[], nnx.State]  # jitted: creates the state already sharded
  # jitted, donating its argument: the state around given (sharded) model params, optimizer
  # state initialised from them; the random init it traces is dead code and compiled away
  init_from_params: Callable[[nnx.State], nnx.State]


def make_state_spec(
  model_cfg: ModelConfig, tx: optax.GradientTransformation, mesh, seed: int
) -> StateSpec:
  """Abstract first: eval_shape the state, derive shardings, jit the initializer onto them."""

  def create() -> TrainState:
    return TrainState(Transformer(model_cfg, rngs=nnx.Rngs(params=seed)), tx)

  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  shardings = sharding.state_shardings(abstract, mesh, sharding.PARAM_RULES)
  abstract = sharding.with_shardings(abstract, shardings)
  init = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)

  def around(params: nnx.State) -> nnx.State:
    model = Transformer(model_cfg, rngs=nnx.Rngs(params=seed))
    nnx.update(model, params)  # every param replaced: XLA drops the random init
    return nnx.split(TrainState(model, tx))[1]

  param_shardings = nnx.state(shardings, nnx.Param)["model"]
  init_from_params = jax.jit(
    around, in_shardings=(param_shardings,), out_shardings=shardings, donate_argnums=(0,)
  )
  return StateSpec(graphdef, abstract, shardings, init, init_from_params)


def state_bytes_per_device(abstract: nnx.State) -> int:
  """Bytes of the (sharded) train state on the most loaded device, from shapes alone."""
  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(abstract):
    shard = leaf.sharding.shard_shape(leaf.shape)
    nbytes = math.prod(shard) * np.dtype(leaf.dtype).itemsize
    for device in leaf.sharding.device_set:
      per_device[device] = per_device.get(device, 0) + nbytes
  return max(per_device.values(), default=0)


def check_state_fits(abstract: nnx.State) -> None:
  """A one-line ConfigError, before anything is allocated, when parameters and optimizer state
  alone exceed a device's memory (activations need more on top)."""
  need, have = state_bytes_per_device(abstract), sharding.device_memory_bytes()
  if need > have:
    raise config_lib.ConfigError(
      f"the train state (parameters and optimizer moments) needs {need / 2**30:.1f} GiB per "
      f"device, more than a device's {have / 2**30:.1f} GiB; shard it over more devices "
      "(mesh.shape) or train a smaller model"
    )
