"""What an SBD train step costs against an NTP step of the same model and rows, timed side by
side in one process.

    python -m benchmarks.train_step [--config=configs/tiny.py] [--steps=7] [--out=DIR]
        [--config.train.batch_size=8 ...]

The config's model, rows (train.batch_size x train.seq_len) and objective, on one device: the
jitted, donated train step of each mode (`training.step.make_train_step`), compile excluded,
the median of `--steps` steps taken alternately. An SBD step processes 2L tokens ([x ; x̂]) where
an NTP step processes L; the table gives both steps' seconds, their ratio, and tokens processed
per second. On a device with a known peak (`metrics.peak_flops_per_device`) it also gives MFU two
ways: the model FLOPs of the rows' L tokens (an NTP step's; MaxText's convention) and those of
the tokens the step processes (2L for SBD); rematerialisation is not counted. Where the device
reports it, the peak memory in use after both modes' steps. Outputs: DIR/results.json,
DIR/train_step.md.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags

import sbd_jax
from benchmarks import report
from sbd_jax import cli, sharding
from sbd_jax import config as config_lib
from sbd_jax.tpu.step_time import model_flops
from sbd_jax.training.metrics import peak_flops_per_device
from sbd_jax.training.optim import make_optimizer
from sbd_jax.training.state import make_state_spec
from sbd_jax.training.step import make_train_step
from sbd_jax.training.trainer import global_batch

MODES = ("ntp", "sbd")


def random_batch(rows: int, seq_len: int, vocab: int) -> dict[str, np.ndarray]:
  """One document per row, every token a target."""
  rng = np.random.default_rng(0)
  return {
    "tokens": rng.integers(0, min(vocab - 1, 256), (rows, seq_len)),
    "segment_ids": np.ones((rows, seq_len)),
    "positions": np.tile(np.arange(seq_len), (rows, 1)),
    "loss_mask": np.ones((rows, seq_len)),
  }


def time_steps(c, steps: int) -> dict[str, list[float]]:
  """Seconds of each timed step per mode, the modes alternating step by step."""
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  model_cfg = config_lib.to_model_config(c)
  mask_id = model_cfg.vocab_size - 1
  obj_cfg = config_lib.to_objective_config(c, mask_id)
  tx, _ = make_optimizer(c.optim, c.train.steps)
  spec = make_state_spec(model_cfg, tx, mesh, seed=0)
  rows, seq_len = c.train.batch_size, c.train.seq_len
  batch = global_batch(random_batch(rows, seq_len, model_cfg.vocab_size), mesh)
  run = {}
  for mode in MODES:
    step = make_train_step(spec, dataclasses.replace(obj_cfg, mode=mode), mesh, seed=0)
    state = spec.init()
    state, metrics = step(state, batch, jnp.asarray(0))  # compile
    jax.block_until_ready(metrics)
    run[mode] = [step, state]
  times = {mode: [] for mode in MODES}
  for i in range(steps):
    for mode in MODES:
      step, state = run[mode]
      start = time.perf_counter()
      state, metrics = step(state, batch, jnp.asarray(i + 1))
      jax.block_until_ready(metrics)
      times[mode].append(time.perf_counter() - start)
      run[mode][1] = state
  return times


def peak_memory_bytes() -> int | None:
  """The device's peak bytes in use so far, where its allocator reports it (GPU, TPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def summarize(c, times: dict[str, list[float]], peak_flops: float = 0.0) -> dict:
  """Median seconds per mode, their ratio, tokens/s and, given the device's peak FLOP/s, MFU:
  "rows" counts the model FLOPs of the rows' L tokens, "processed" those of the tokens each
  step processes (L for NTP, 2L for SBD)."""
  rows, seq_len = c.train.batch_size, c.train.seq_len
  median = {mode: statistics.median(t) for mode, t in times.items()}
  processed = {"ntp": rows * seq_len, "sbd": 2 * rows * seq_len}
  row_flops = model_flops(c, num_devices=1)["model_flops_per_device"]
  r = {
    "device": jax.devices()[0].device_kind,
    "model": f"{c.model.num_layers} layers, D={c.model.embed_dim}, remat {c.model.remat}",
    "rows": rows,
    "seq_len": seq_len,
    "steps": len(times["ntp"]),
    "seconds": median,
    "sbd_over_ntp": median["sbd"] / median["ntp"],
    "processed_tokens_per_s": {m: processed[m] / median[m] for m in MODES},
    "model_flops_per_step": {m: row_flops * processed[m] / processed["ntp"] for m in MODES},
    "peak_flops": peak_flops,
    "samples_s": times,
  }
  if peak_flops:
    r["mfu"] = {
      "rows": {m: row_flops / median[m] / peak_flops for m in MODES},
      "processed": {m: row_flops * processed[m] / processed["ntp"] / median[m] / peak_flops
                    for m in MODES},
    }  # fmt: skip
  return r


def format_markdown(r: dict) -> str:
  header = ["step", "seconds", "processed tokens / s"]
  body = [
    [mode, f"{r['seconds'][mode]:.3f}", f"{r['processed_tokens_per_s'][mode]:.0f}"]
    for mode in MODES
  ]
  if "mfu" in r:
    header += ["MFU, rows' L tokens", "MFU, processed tokens"]
    for row, mode in zip(body, MODES):
      row += [f"{100 * r['mfu']['rows'][mode]:.1f} %", f"{100 * r['mfu']['processed'][mode]:.1f} %"]
  memory = ""
  if r.get("peak_memory_bytes"):
    memory = f"; peak memory in use {r['peak_memory_bytes'] / 2**30:.1f} GiB"
  return (
    f"{r['rows']} rows x {r['seq_len']} tokens on {r['device']} ({r.get('model', '')}), median of "
    f"{r['steps']} steps; SBD step / NTP step: {r['sbd_over_ntp']:.2f}x{memory}\n\n"
    + report.table(header, body)
  )


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    config_lib.validate(f.config, num_devices=1)
  except config_lib.ConfigError as e:
    cli.fail(e)
  r = summarize(f.config, time_steps(f.config, f.steps), peak_flops_per_device())
  r["peak_memory_bytes"] = peak_memory_bytes()
  table = format_markdown(r)
  print(table)
  if f.out:
    report.save(f.out, "train_step", r, table)


if __name__ == "__main__":
  _REPO = os.path.dirname(os.path.dirname(sbd_jax.__file__))
  config_flags.DEFINE_config_file(
    "config", os.path.join(_REPO, "configs", "tiny.py"), "Experiment config file."
  )
  flags.DEFINE_integer("steps", 7, "Timed steps per mode.")
  flags.DEFINE_string("out", None, "Also write results.json and train_step.md here.")
  cli.run(main)
