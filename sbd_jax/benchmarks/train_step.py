"""Train-step cost of SBD vs NTP, measured side by side in one process.

    python -m sbd_jax.benchmarks.train_step [--rows=16 --seq_len=256 --steps=5]

Times the jitted, donated train step of the `tiny` model in NTP and SBD mode with the chunked
attention at a few chunk sizes (among them one row, `seq_len`: an NTP row is then one chunk and
an SBD row [x ; x̂] two, whose never-visible pair is skipped), at one row with the MLP's weight
gradients left to autodiff (`ModelConfig.mlp_grads_transpose_input` off, as on TPU), and in SBD
mode with the dense reference (layers unrolled, and scanned as the TPU presets run them). Prints
seconds per step and the ratio to the first row, NTP at the `tiny` default chunk of 128
(compile excluded, median over `steps`).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sbd_jax import cli, config, sharding
from sbd_jax.model import architectures
from sbd_jax.sbd.objective import ObjectiveConfig
from sbd_jax.training.optim import make_optimizer
from sbd_jax.training.state import make_state_spec
from sbd_jax.training.step import make_train_step
from sbd_jax.training.trainer import global_batch


def variants(seq_len: int):
  autodiff_mlp = dict(attention_chunk=seq_len, mlp_grads_transpose_input=False)
  for chunk in dict.fromkeys((128, seq_len)):  # the tiny default first
    yield f"ntp chunked (chunk {chunk})", architectures.tiny(attention_chunk=chunk), "ntp"
  yield f"ntp chunk {seq_len}, autodiff MLP grads", architectures.tiny(**autodiff_mlp), "ntp"
  for chunk in sorted({64, 128, seq_len, min(512, 2 * seq_len)}):
    yield f"sbd chunked (chunk {chunk})", architectures.tiny(attention_chunk=chunk), "sbd"
  yield f"sbd chunk {seq_len}, autodiff MLP grads", architectures.tiny(**autodiff_mlp), "sbd"
  yield "sbd dense reference", architectures.tiny(attention_impl="dense"), "sbd"
  scanned = architectures.tiny(attention_impl="dense", scan_layers=True)
  yield "sbd dense, scanned layers", scanned, "sbd"


def time_step(model_cfg, mode: str, rows: int, seq_len: int, steps: int) -> float:
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  tx, _ = make_optimizer(config.base_config().optim, total_steps=100)
  spec = make_state_spec(model_cfg, tx, mesh, seed=0)
  step_fn = make_train_step(spec, ObjectiveConfig(mode=mode, mask_id=259), mesh, seed=0)
  rng = np.random.default_rng(0)
  batch = global_batch(
    {
      "tokens": rng.integers(0, 256, (rows, seq_len)),
      "segment_ids": np.ones((rows, seq_len)),
      "positions": np.tile(np.arange(seq_len), (rows, 1)),
      "loss_mask": np.ones((rows, seq_len)),
    },
    mesh,
  )
  state = spec.init()
  state, metrics = step_fn(state, batch, jnp.asarray(0))  # compile
  jax.block_until_ready(metrics)
  times = []
  for i in range(steps):
    start = time.perf_counter()
    state, metrics = step_fn(state, batch, jnp.asarray(i + 1))
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  f = flags.FLAGS
  results = {
    name: time_step(cfg, mode, f.rows, f.seq_len, f.steps)
    for name, cfg, mode in variants(f.seq_len)
  }
  base = next(iter(results.values()))
  print(
    f"tiny model, {f.rows} rows x {f.seq_len} tokens, median of {f.steps} steps, "
    f"{jax.devices()[0].device_kind}"
  )
  for name, seconds in results.items():
    print(f"{name:36s} {seconds:7.3f} s/step  {seconds / base:5.2f}x the first row")


if __name__ == "__main__":
  flags.DEFINE_integer("rows", 16, "Rows per batch.")
  flags.DEFINE_integer("seq_len", 256, "Tokens per row (the SBD input is twice as long).")
  flags.DEFINE_integer("steps", 5, "Timed steps per variant.")
  cli.run(main)
