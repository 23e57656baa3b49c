"""Held-out evaluation while training (`train.eval_every`, the `eval` group).

Every evaluation reads the same `eval.batches` global batches of held-out documents
(`data.heldout`; built once, per row slice as training reads its own, so the numbers do not
depend on the process count) and the same masks (a fixed key), so successive evaluations differ
only by the weights. Per batch, one SBD forward per masking rate in `eval.mask_rates`, at block
size `eval.block_size`: the NTP loss comes from the clean half of the first (it attends only to
itself, as in an NTP forward), the MATP loss per masked token from every block half. An NTP run
evaluates its NTP loss alone. Nothing is built when `train.eval_every` is 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax import distributed, sharding
from sbd_jax.data import heldout as heldout_data
from sbd_jax.data.pipeline import make_slices_dataset
from sbd_jax.sbd import objective
from sbd_jax.training.state import StateSpec

# A held-out decode: (params) -> {scalar name: value}, every process taking part.
DecodeEval = Callable[[nnx.State], dict[str, float]]


def metric_names(mode: str, mask_rates) -> list[str]:
  """The scalars one evaluation logs (logged under `heldout/`), in order."""
  if mode == "ntp":
    return ["ntp_loss"]
  return ["ntp_loss"] + [f"matp_loss_mask{rate:g}" for rate in mask_rates]


def make_eval_step(
  spec: StateSpec, obj_cfg: objective.ObjectiveConfig, mesh, mask_rates, block_size: int, seed
):
  """Jitted (state, batch) -> {name: (cross-entropy sum, token count)} over one batch."""
  key = jax.random.key(seed)
  rates = tuple(float(r) for r in mask_rates)

  def sums(ce_BL, weights_BL):
    return jnp.sum(ce_BL * weights_BL), jnp.sum(weights_BL)

  def eval_fn(state: nnx.State, batch: dict):
    model = nnx.merge(spec.graphdef, state).model
    seq_len = batch["tokens"].shape[1]
    out = {}
    if obj_cfg.mode == "ntp":
      sbd, _ = objective.make_batch(batch, key, obj_cfg)
      ce_BT = objective.token_cross_entropy(model, sbd, obj_cfg)
      return {"ntp_loss": sums(ce_BT, sbd.ntp_weights)}
    for i, rate in enumerate(rates):
      sbd, _ = objective.make_batch(
        batch, jax.random.fold_in(key, i), obj_cfg, block_size=block_size, mask_rate=rate
      )
      ce_BT = objective.token_cross_entropy(model, sbd, obj_cfg)
      if i == 0:
        out["ntp_loss"] = sums(ce_BT[:, :seq_len], sbd.ntp_weights)
      out[f"matp_loss_mask{rate:g}"] = sums(ce_BT[:, seq_len:], sbd.matp_weights)
    return out

  return jax.jit(
    eval_fn,
    in_shardings=(spec.shardings, sharding.batch_sharding(mesh)),
    out_shardings=sharding.replicated(mesh),
  )


class HeldoutEvaluator:
  """Evaluates the training state on the held-out batches; `decode` (optional) adds a small
  decode's accuracy and forwards."""

  def __init__(
    self,
    c: ml_collections.ConfigDict,
    spec: StateSpec,
    obj_cfg: objective.ObjectiveConfig,
    mesh,
    tokenizer,
    to_global: Callable[[dict[str, np.ndarray]], dict[str, jax.Array]],
    decode: DecodeEval | None = None,
  ):
    self.every = c.train.eval_every
    self._c, self._mesh, self._tokenizer, self._to_global = c, mesh, tokenizer, to_global
    self._decode = decode
    self._names = metric_names(obj_cfg.mode, c.eval.mask_rates)
    block_size = c.eval.block_size or c.sample.block_size
    self._step = make_eval_step(spec, obj_cfg, mesh, c.eval.mask_rates, block_size, c.train.seed)
    self._compiled: Callable | None = None  # `_step`, compiled by every process before its run
    self._batches: list[dict[str, jax.Array]] | None = None

  def due(self, step: int) -> bool:
    """Whether the state after `step` steps is evaluated."""
    return step % self.every == 0

  def _held_out_batches(self) -> list[dict[str, jax.Array]]:
    c = self._c
    data_cfg, part = heldout_data.eval_data_config(c)
    with data_cfg.unlocked():
      data_cfg.num_workers = 0  # read once, a few batches
    slice_count = sharding.row_shards(self._mesh)
    batches = make_slices_dataset(
      data_cfg,
      self._tokenizer,
      slice_rows=c.train.batch_size // slice_count,
      slices=sharding.batch_row_slices(self._mesh, c.train.batch_size),
      slice_count=slice_count,
      seq_len=c.train.seq_len,
      seed=c.train.seed,
      eos_tail=config_lib.eos_tail_length(c),
      part=part,
    )
    return [self._to_global(b) for b in itertools.islice(iter(batches), c.eval.batches)]

  def __call__(self, state: nnx.State) -> dict[str, float]:
    """{name: value} of the state, names without `heldout/`: token-weighted means over the
    held-out batches, then the decode's scalars."""
    if self._batches is None:
      self._batches = self._held_out_batches()
    if self._compiled is None:
      self._compiled = distributed.compiled_on_every_process(
        self._step, "held-out evaluation", state, self._batches[0]
      )
    totals: dict[str, np.ndarray] = {}
    for batch in self._batches:
      for name, pair in jax.device_get(self._compiled(state, batch)).items():
        totals[name] = totals.get(name, 0) + np.asarray(pair, np.float64)
    values = {name: float(totals[name][0] / max(totals[name][1], 1.0)) for name in self._names}
    if self._decode is not None:
      values.update(self._decode(nnx.state(state["model"], nnx.Param)))
    return values
