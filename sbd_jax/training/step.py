"""The jitted train step: the objective's loss and gradients, one optimizer update, metrics.

A run that opens with an NTP phase (`config.ntp_phase_steps`) compiles two steps over the same
state; each states what one of its rows costs (the SBD step processes 2L tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import optax
from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax import sharding
from sbd_jax.model import layers
from sbd_jax.sbd import objective
from sbd_jax.training import optim
from sbd_jax.training.metrics import flops_per_token
from sbd_jax.training.state import StateSpec


def make_train_step(spec: StateSpec, obj_cfg: objective.ObjectiveConfig, mesh, seed: int):
  """Jitted (state, batch, step) -> (state, metrics) with explicit shardings and donation.

  Compute layouts that only one platform needs are chosen here, from the mesh's platform: on
  the CPU the MLP's weight gradients come from one transposed copy of its input
  (`layers.mlp_weight_grads_from_transposed_input`; same values)."""
  base_key = jax.random.key(seed)
  on_cpu = mesh.devices.flat[0].platform == "cpu"

  def step_fn(state: nnx.State, batch: dict, step: jax.Array):
    train_state = nnx.merge(spec.graphdef, state)
    rng = jax.random.fold_in(base_key, step)

    def loss_of(model):
      return objective.loss_fn(model, batch, rng, obj_cfg)

    with layers.mlp_weight_grads_from_transposed_input(on_cpu):
      (_, metrics), grads = nnx.value_and_grad(loss_of, has_aux=True)(train_state.model)
    train_state.optimizer.update(train_state.model, grads)
    metrics["grad_norm"] = optax.tree.norm(grads)
    skips = optim.skipped_updates(train_state.optimizer.opt_state)
    if skips is not None:
      metrics["skipped_updates"], metrics["update_skipped"] = skips
    return nnx.state(train_state), metrics

  replicated = sharding.replicated(mesh)
  return jax.jit(
    step_fn,
    in_shardings=(spec.shardings, sharding.batch_sharding(mesh), replicated),
    out_shardings=(spec.shardings, replicated),
    donate_argnums=(0,),
  )


@dataclasses.dataclass(frozen=True)
class Phase:
  """A compiled step and what one of its rows costs: the SBD step processes 2L tokens."""

  step: Callable
  processed_per_row: int
  flops_per_token: float


def training_phases(c, spec: StateSpec, obj_cfg, mesh, n_params: int) -> dict[str, Phase]:
  """{"sbd": the configured objective's step} and, when the run opens with an NTP phase
  (`config.ntp_phase_steps` > 0), {"ntp": that phase's step}; both update the same state."""
  model_cfg, seq_len = config_lib.to_model_config(c), c.train.seq_len

  def phase(cfg: objective.ObjectiveConfig) -> Phase:
    factor = 1 if cfg.mode == "ntp" else 2
    return Phase(
      make_train_step(spec, cfg, mesh, c.train.seed),
      factor * seq_len,
      flops_per_token(model_cfg, n_params, seq_len),
    )

  phases = {"sbd": phase(obj_cfg)}
  if config_lib.ntp_phase_steps(c) > 0:  # 0 for an NTP run
    phases["ntp"] = phase(dataclasses.replace(obj_cfg, mode="ntp"))
  return phases
