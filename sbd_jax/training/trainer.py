"""The training loop: sharded state, jitted SBD step, Grain data, Orbax checkpoints, metrics.

`train(config, workdir)` is the library entry point; `python -m sbd_jax.train` and the launch
scripts only parse flags and call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from sbd_jax import compile_cache, distributed, sharding
from sbd_jax import config as config_lib
from sbd_jax.data import mixture, sources, vocab
from sbd_jax.data.pipeline import make_slices_dataset
from sbd_jax.data.tokenizer import load_tokenizer
from sbd_jax.model.transformer import count_params
from sbd_jax.run import checkpointing
from sbd_jax.run import workdir as workdir_lib
from sbd_jax.training import heldout, optim
from sbd_jax.training.dashboards import Dashboards
from sbd_jax.training.metrics import (
  MetricsLogger,
  MetricWindow,
  Throughput,
  peak_flops_per_device,
)
from sbd_jax.training.state import StateSpec, TrainState, check_state_fits, make_state_spec
from sbd_jax.training.step import training_phases
from sbd_jax.training.stopping import StopRequest


def global_batch(local: dict[str, np.ndarray], mesh, batch_size: int | None = None):
  """This process's rows (its row slices, `sharding.batch_row_slices`, in order) -> one global
  jax.Array of `batch_size` rows per field, sharded over (data, fsdp)."""
  target = sharding.batch_sharding(mesh)
  return {
    k: jax.make_array_from_process_local_data(
      target, np.asarray(v, np.int32), None if batch_size is None else (batch_size, v.shape[1])
    )
    for k, v in local.items()
  }


def run_tokenizer(c: ml_collections.ConfigDict, workdir: str):
  """The config's tokenizer; "words" is built from the training data on the first start."""
  if c.tokenizer != "words":
    return load_tokenizer(c.tokenizer)
  seed = c.train.seed if c.data.seed is None else c.data.seed
  return vocab.ensure_in_workdir(
    workdir, c.data, seed, c.model.vocab_size, write=jax.process_index() == 0
  )


def _warn_if_rows_cut_problems(c: ml_collections.ConfigDict, tokenizer) -> None:
  if c.data.source != "arithmetic":
    return
  longest = config_lib.longest_arithmetic_document(c, tokenizer)
  if longest > c.train.seq_len:
    logging.warning(
      "train.seq_len %d is shorter than the longest arithmetic problem (%d tokens with BOS, "
      "EOS and EOS tail): problems are cut across rows, answers apart from their questions",
      c.train.seq_len,
      longest,
    )


def _restore_or_init(c, spec: StateSpec, manager, data_iter) -> tuple[TrainState, int]:
  """(state, first step): the newest restorable checkpoint (with the data iterator's position),
  else a fresh init, optionally with params from `train.init_from`.

  A checkpoint that fails to restore (files missing or truncated, e.g. a host died mid-save
  on a filesystem without atomic rename) is skipped with a warning naming it; when checkpoints
  exist but none restores, this raises instead of silently starting over.
  """
  steps = sorted(manager.all_steps(), reverse=True)
  for i, step in enumerate(steps):
    try:
      state = checkpointing.restore(manager, step, spec.abstract, data_iter)
    except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
      reason = " ".join(str(e).split())[:200]
      logging.warning(
        "checkpoint %d could not be restored (%s): %s", step, type(e).__name__, reason
      )
      continue
    for torn in steps[:i]:  # newer and unusable: make room for the steps about to be redone
      manager.delete(torn)
      logging.warning("removed the unrestorable checkpoint %d", torn)
    return state, step
  if steps:
    raise FileNotFoundError(
      f"none of the checkpoints {steps} in {manager.directory} could be restored; move them "
      "away to start over"
    )
  if config_lib.random_init(c):
    return spec.init(), 0
  # Straight into the sharded layout: the params restored onto their shardings, the optimizer
  # state built around them; no random model is materialised first (8B: 32 GB of float32).
  params = checkpointing.load_params(
    c.train.init_from, nnx.state(spec.abstract, nnx.Param)["model"]
  )
  return spec.init_from_params(params), 0


def train(
  c: ml_collections.ConfigDict,
  workdir: str,
  decode_eval: Callable[..., heldout.DecodeEval] | None = None,
) -> dict[str, float]:
  """Train (or resume) the run in `workdir`; returns the last logged metrics.

  Restore (or init), step, log, evaluate on held-out data (`train.eval_every`), save, export.
  Metrics of step t are fetched after step t + 1 has been dispatched, so logging never stalls
  the device. A workdir started with another config is refused before anything in it is
  touched (`workdir.RESUMABLE_FIELDS` may differ). `decode_eval(c, tokenizer, mask_id)`, when
  given and `eval.decode_problems` > 0, makes the held-out decode of each evaluation (the
  decoding and scoring live in later stages: `sbd_jax.evals.while_training`).
  """
  _refuse_another_runs_workdir(c, workdir)
  config_lib.random_init(c)  # a fine-tune config without its params stops here
  tokenizer = run_tokenizer(c, workdir)
  config_lib.validate(c, num_devices=jax.device_count(), tokenizer=tokenizer)
  _warn_if_rows_cut_problems(c, tokenizer)
  compile_cache.enable_for_run(c, workdir)
  model_cfg = config_lib.to_model_config(c)
  obj_cfg = config_lib.to_objective_config(c, config_lib.resolve_mask_id(c, tokenizer))
  mesh = sharding.mesh_from_config(c.mesh)
  tx, schedule = optim.make_optimizer(c.optim, c.train.steps, c.train.skip_nonfinite_steps)
  spec = make_state_spec(model_cfg, tx, mesh, c.train.seed)
  check_state_fits(spec.abstract)

  num_hosts, host = jax.process_count(), jax.process_index()
  if num_hosts > 1 and c.data.source == "jsonl" and host == 0:
    print(
      "note: every host parses the whole JSONL corpus; for large corpora convert it once "
      "(python -m sbd_jax.data.to_array_record) and train with data.source=array_record",
      flush=True,
    )
  bad_records = sources.BadRecords() if c.data.skip_bad_records else None
  mixed = mixture.MixtureCounts(len(c.data.mixture)) if c.data.get("mixture") else None
  data_iter = _data_iterator(c, tokenizer, mesh, bad_records, mixed)
  manager = _open_checkpoints(c, workdir, mesh)
  state, start_step = _restore_or_init(c, spec, manager, data_iter)

  n_params = count_params(state["model"])
  throughput = Throughput(c.train.peak_tflops_per_device * 1e12 or peak_flops_per_device())
  logger = _metrics_logger(c, workdir, start_step)
  if start_step:
    logger.info(f"resumed from the step-{start_step} checkpoint in {workdir}")
  elif not config_lib.random_init(c):
    logger.info(f"params initialised from {c.train.init_from}")
  logger.info(
    f"{n_params / 1e6:.2f}M params | mesh {dict(mesh.shape)} | mode {obj_cfg.mode} | "
    f"k ~ U{{{obj_cfg.k_min}..{obj_cfg.k_max}}} | steps {start_step}->{c.train.steps}"
  )

  if bad_records is not None and bad_records.count:
    logger.info(
      f"data: skipping {bad_records.count} bad records (data.skip_bad_records), e.g. "
      f"{bad_records.examples[0]}"
    )

  phases = training_phases(c, spec, obj_cfg, mesh, n_params)
  window = MetricWindow(
    logger,
    schedule,
    max_skipped=c.train.skip_nonfinite_steps,
    counters=_counters(bad_records, mixed),
  )
  evaluator = _heldout_evaluator(c, spec, obj_cfg, mesh, tokenizer, decode_eval)
  stop = StopRequest(c.train.max_hours)
  try:
    state, last, end = _loop(
      c, mesh, state, start_step, phases, data_iter, manager, throughput, window, stop, evaluator
    )
  except (FloatingPointError, sources.DataError):
    manager.wait_until_finished()  # earlier checkpoints finish writing; nothing newer is saved
    manager.close()
    raise
  finally:
    stop.close()

  if end < c.train.steps:  # stopped early: the checkpoint at `end` is the resume point
    manager.wait_until_finished()
    manager.close()
    logger.info(
      f"stopped at step {end} ({stop.reason}); checkpoint saved in {workdir}, run the same "
      "command to resume"
    )
    logger.close()
    return {**last, "stopped_at": end}
  if start_step < c.train.steps:
    checkpointing.save(manager, c.train.steps, state, data_iter, force=True)
  manager.wait_until_finished()
  manager.close()
  # Every process takes part in the (collective) params export.
  path = checkpointing.export_params(workdir, nnx.state(state["model"], nnx.Param))
  logger.info(f"params exported to {path}")
  logger.close()
  return last


def _metrics_logger(c: ml_collections.ConfigDict, workdir: str, start_step: int):
  lead = jax.process_index() == 0
  return MetricsLogger(
    workdir,
    total_steps=c.train.steps,
    start_step=start_step,
    enabled=lead,
    progress_bar=c.train.progress_bar,
    dashboards=Dashboards(
      workdir, wandb_project=c.train.wandb_project, config=c.to_dict(), enabled=lead
    ),
  )


def _heldout_evaluator(c, spec, obj_cfg, mesh, tokenizer, decode_eval):
  """The held-out evaluation of `train.eval_every` (None when 0), with the held-out decode
  when `eval.decode_problems` > 0 and the caller gave a `decode_eval`."""
  if not c.train.eval_every:
    return None
  decode = None
  if c.eval.decode_problems and decode_eval is None:
    logging.warning(
      "eval.decode_problems is set but train() was given no decode_eval: held-out losses only "
      "(python -m sbd_jax.train passes sbd_jax.evals.while_training.decoder)"
    )
  elif c.eval.decode_problems:
    decode = decode_eval(c, tokenizer, obj_cfg.mask_id)
  return heldout.HeldoutEvaluator(
    c,
    spec,
    obj_cfg,
    mesh,
    tokenizer,
    lambda local: global_batch(local, mesh, c.train.batch_size),
    decode,
  )


def _refuse_another_runs_workdir(c: ml_collections.ConfigDict, workdir: str) -> None:
  """A workdir started with another config is refused before anything in it is touched."""
  conflicts = workdir_lib.resume_conflicts(workdir, c)
  if conflicts:
    shown = "; ".join(conflicts[:6]) + (
      f"; and {len(conflicts) - 6} more" if len(conflicts) > 6 else ""
    )
    raise config_lib.ConfigError(
      f"{workdir} holds a run started with a different config ({shown}): resume it with the "
      "config it was started with, or train in a new workdir"
    )


def _counters(bad_records, mixed):
  """The host-side totals logged with every record: records skipped, a mixture's shares."""
  if bad_records is None and mixed is None:
    return None
  return lambda: {
    **({"skipped_records": bad_records.count} if bad_records is not None else {}),
    **(mixed.shares() if mixed is not None else {}),
  }


def _data_iterator(c, tokenizer, mesh, bad_records, mixed=None) -> grain.DatasetIterator:
  """This process's batches. Each row slice of the global batch comes from its own shard of
  the data, read by the processes whose devices hold that slice (all of them alike): the batch
  is the same for any number of processes, and replicas of a slice agree."""
  slice_count = sharding.row_shards(mesh)
  return iter(
    make_slices_dataset(
      c.data,
      tokenizer,
      slice_rows=c.train.batch_size // slice_count,
      slices=sharding.batch_row_slices(mesh, c.train.batch_size),
      slice_count=slice_count,
      seq_len=c.train.seq_len,
      seed=c.train.seed,
      eos_tail=config_lib.eos_tail_length(c),
      bad_records=bad_records,
      mixture_counts=mixed,
    )
  )


def _open_checkpoints(c, workdir: str, mesh) -> ocp.CheckpointManager:
  """The workdir's checkpoint manager, after refusing a resume whose data layout (processes,
  row shards) is not its checkpoints'; the lead records the config and the layout."""
  manager = checkpointing.make_manager(
    workdir, c.checkpoint.every_steps, c.checkpoint.keep, c.checkpoint.async_save
  )
  layout = workdir_lib.data_layout(jax.process_count(), sharding.row_shards(mesh))
  if manager.all_steps() and (refusal := workdir_lib.data_layout_conflict(workdir, layout)):
    manager.close()
    raise config_lib.ConfigError(refusal)
  if jax.process_index() == 0:
    workdir_lib.write_config(workdir, c)
    workdir_lib.write_data_layout(workdir, layout)
  return manager


def _loop(
  c, mesh, state, start_step, phases, data_iter, manager, throughput, window, stop, evaluator
):
  """The steps from `start_step`: dispatch, account for the previous step, log, evaluate,
  checkpoint. Returns (state, last logged metrics, the step reached); on a stop request it checkpoints
  the step reached and returns early."""
  rows = c.train.batch_size
  # Real tokens are counted in this process's rows; the batch's are that much of it scaled.
  share = sharding.row_shards(mesh) / len(sharding.batch_row_slices(mesh, rows))
  last: dict[str, float] = {}
  pending = None  # (step, metrics, perf) of the previous step
  ntp_steps = config_lib.ntp_phase_steps(c)
  compiled: dict[str, Callable] = {}  # each phase's step, compiled by every process before its run
  with sharding.activation_sharding(mesh):
    for step in range(start_step, c.train.steps):
      local = next(data_iter)
      name = "ntp" if step < ntp_steps else "sbd"
      phase = phases[name]
      real = int(np.count_nonzero(local["segment_ids"]) * share)
      throughput.add(real, rows * phase.processed_per_row, phase.flops_per_token)
      batch, index = global_batch(local, mesh, rows), jnp.asarray(step, jnp.int32)
      start = time.perf_counter()
      first = name not in compiled
      if first:
        compiled[name] = distributed.compiled_on_every_process(
          phase.step, f"{name} step", state, batch, index
        )
      state, metrics = compiled[name](state, batch, index)
      if first:
        jax.block_until_ready(metrics)
        window.logger.info(
          f"first {name} step (compile or cache load, then the step): "
          f"{time.perf_counter() - start:.1f} s"
        )
      if pending is not None:
        last = window.finish(*pending)
      perf = None
      if (step + 1) % c.train.log_every == 0 or step + 1 == c.train.steps:
        jax.block_until_ready(metrics)
        perf = throughput.read_and_restart()
      elif not throughput.started():  # the first step compiles: measure from its end
        jax.block_until_ready(metrics)
        throughput.restart()
      pending = (step, metrics, perf)
      if evaluator is not None and evaluator.due(step + 1):
        window.logger.log_heldout(step + 1, evaluator(state))
        throughput.restart()  # the evaluation's time is not training's
      stopping = step + 1 < c.train.steps and stop.should_stop(step + 1)
      if stopping or (step + 1) % c.checkpoint.every_steps == 0 or step + 1 == c.train.steps:
        last, pending = window.finish(*pending), None  # never save a non-finite state
        if step + 1 < c.train.steps:
          checkpointing.save(manager, step + 1, state, data_iter, force=True)
      if stopping:
        return state, last, step + 1
    if pending is not None:
      last = window.finish(*pending)
  return state, last, c.train.steps
