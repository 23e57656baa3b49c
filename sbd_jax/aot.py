"""Ahead-of-time compilation for a TPU slice this machine does not have: memory fit and FLOPs.

    python -m sbd_jax.aot --config=configs/llama8b.py --topology=v5p-16 [--mode=train]
        [--config.train.seq_len=8192 ...] [--step_time_s=T] [--json]
    python -m sbd_jax.aot --config=configs/llama8b.py --topology=v5e-8 --mode=decode
        [--rows=8 --prompt_len=2048 --max_new_tokens=512 --block_size=16 --decode_mode=sbd]
        [--refill --queue=64 --refill_rows=1]

With `libtpu` installed (`pip install -e ".[tpu]"`), JAX on a CPU-only machine can describe a
TPU slice and compile for it. This builds the abstract sharded train state with `eval_shape`
(nothing is allocated), lowers the real train step for the config's mesh over the slice's
devices, compiles it, and prints XLA's per-device memory (arguments, outputs, temporaries)
against the chip's HBM, and its FLOPs per step. It exits 1 with a one-line reason when the
step does not fit. `--mode=decode` does the same for the sampler's decode loop (its KV cache,
weights placed for sampling); with `--refill`, for the loop that decodes a queue of `--queue`
prompts through the rows, finished rows refilled `--refill_rows` at a time (`decode_queue`).

`--topology` takes a slice name (`v5p-16`: 16 TensorCores = 8 chips; `v5e-16` / `v6e-16`: 16
chips; `v4-16`: 16 TensorCores) or a chip grid as JAX names it (`v5p:2x2x4`, `v6e:4x4`).
`--num_slices=N` compiles for N such slices joined by the data-centre network (multislice),
on the hybrid mesh `mesh.dcn_shape` describes (default: the slices on the data axis).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags
from ml_collections import config_flags

from sbd_jax import cli, sharding
from sbd_jax import config as config_lib
from sbd_jax.model.transformer import count_params
from sbd_jax.training import optim, trainer
from sbd_jax.training.metrics import flops_per_token


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_bytes: int  # per chip
  peak_flops: float  # dense bf16 FLOP/s per chip
  cores_in_slice_name: bool  # v4-N / v5p-N count TensorCores (2 per chip), v5e-N / v6e-N chips
  grid_dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)


PROGRAMS = {"train": "train step", "decode": "decode loop"}

# Public spec sheets.
CHIPS = {
  "v4": Chip(32 * 2**30, 275e12, True, 3),
  "v5p": Chip(95 * 2**30, 459e12, True, 3),
  "v5e": Chip(16 * 2**30, 197e12, False, 2),
  "v6e": Chip(32 * 2**30, 918e12, False, 2),
}


def chip_grid(chips: int, dims: int) -> str:
  """The most cubic (dims=3) or square (dims=2) power-of-two grid of `chips` chips."""
  if chips < 1 or chips & (chips - 1):
    raise config_lib.ConfigError(f"a slice of {chips} chips is not a power of two")
  if dims == 3 and chips < 8:  # one host's 2x2x1 block, or part of it
    return {1: "1x1x1", 2: "1x2x1", 4: "2x2x1"}[chips]
  exponent, grid = int(math.log2(chips)), [1] * dims
  for i in range(exponent):  # grow the sides in turn: 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
    grid[dims - 1 - i % dims] *= 2
  return "x".join(map(str, sorted(grid)))


def parse_topology(name: str) -> tuple[str, str]:
  """'v5p-16' or 'v5p:2x2x4' -> (chip generation, JAX topology name)."""
  generation, sep, rest = name.partition(":" if ":" in name else "-")
  if generation == "v5litepod":
    generation = "v5e"
  if generation not in CHIPS or not sep or not rest:
    raise config_lib.ConfigError(
      f"unknown topology {name!r}; use e.g. v5p-16, v5e-8, v6e-16, v4-8 or v5p:2x2x4"
    )
  if sep == ":":
    return generation, name
  if not rest.isdigit():
    raise config_lib.ConfigError(f"topology {name!r}: expected a number after '-'")
  chip = CHIPS[generation]
  chips = int(rest) // 2 if chip.cores_in_slice_name else int(rest)
  return generation, f"{generation}:{chip_grid(max(chips, 1), chip.grid_dims)}"


def topology_devices(topology_name: str, num_slices: int = 1) -> list:
  """The devices of `num_slices` slices of `topology_name` (several: a multislice job, whose
  devices carry their `slice_index`)."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-16")  # quiets libtpu's start-up probe
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no lock: nothing runs on a chip
  from jax.experimental import topologies

  if num_slices < 1:
    raise config_lib.ConfigError(f"num_slices must be >= 1, got {num_slices}")
  try:
    return list(
      topologies.get_topology_desc(
        platform="tpu", topology_name=topology_name, num_slices=num_slices
      ).devices
    )
  except Exception as e:  # missing libtpu, or a grid libtpu does not know
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = (
      "" if importlib.util.find_spec("libtpu") else '; libtpu is missing: pip install -e ".[tpu]"'
    )
    raise config_lib.ConfigError(
      f"cannot describe TPU topology {topology_name!r}: {first_line}{hint}"
    ) from None


def abstract_batch(c, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  shape = (c.train.batch_size, c.train.seq_len)
  spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.batch_sharding(mesh))
  return {k: spec for k in ("tokens", "segment_ids", "positions", "loss_mask", "eos_tail")}


def compile_train_step(c, devices) -> tuple[jax.stages.Compiled, int, float]:
  """(compiled SBD train step, parameter count, seconds to compile) for `devices`."""
  config_lib.validate(c, num_devices=len(devices))
  model_cfg = config_lib.to_model_config(c)
  mask_id = c.sbd.mask_id if c.sbd.mask_id >= 0 else model_cfg.vocab_size - 1
  obj_cfg = config_lib.to_objective_config(c, mask_id)
  mesh = sharding.mesh_from_config(c.mesh, devices)
  tx, _ = optim.make_optimizer(c.optim, c.train.steps, c.train.skip_nonfinite_steps)
  spec = trainer.make_state_spec(model_cfg, tx, mesh, c.train.seed)
  step = trainer.make_train_step(spec, obj_cfg, mesh, c.train.seed)
  step_arg = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))
  start = time.perf_counter()
  with sharding.activation_sharding(mesh):
    compiled = step.lower(spec.abstract, abstract_batch(c, mesh), step_arg).compile()
  return compiled, count_params(spec.abstract["model"]), time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """One decode batch: rows, prompt slots, generated tokens, block size, NTP or SBD."""

  rows: int = 8
  prompt_len: int = 2048
  max_new_tokens: int = 512
  block_size: int = 16
  mode: str = "sbd"
  lockstep: bool = False  # SBD rows in lockstep, or moving through their blocks alone
  refill: bool = False  # a queue of prompts through the rows (`decode_queue`)
  queue: int = 64  # with refill: prompts queued
  refill_rows: int = 1  # with refill: rows refilled together


def decode_settings(c, shape: DecodeShape):
  """The sampler settings `compile_decode` compiles (token ids from the config's vocabulary)."""
  from sbd_jax.decode import loop as decode_loop

  vocab = c.model.vocab_size
  mask_id = c.sbd.mask_id if c.sbd.mask_id >= 0 else vocab - 1
  return decode_loop.SamplerSettings(
    eos_id=(mask_id + 1) % vocab,
    pad_id=(mask_id + 2) % vocab,
    mask_id=mask_id,
    mode=shape.mode,
    block_size=shape.block_size,
    max_new_tokens=shape.max_new_tokens,
    lockstep=shape.lockstep,
    refill=shape.refill,
    refill_rows=shape.refill_rows,
  )


def compile_decode(c, devices, shape: DecodeShape) -> tuple[jax.stages.Compiled, int, float]:
  """(compiled decode loop, parameter count, seconds to compile): the sampler's real
  `lax.while_loop` with its KV cache of prompt_len + response slots, weights placed with
  SAMPLING_RULES over the config's mesh in the dtype and layout decoding loads them in
  (`ModelConfig.for_decoding`), rows split over (data, fsdp). With `shape.refill`, the queue
  loop (`decode_queue`) of `shape.queue` prompts, held replicated."""
  from flax import nnx

  from sbd_jax.decode import loop as decode_loop
  from sbd_jax.decode import queue as decode_queue
  from sbd_jax.model.transformer import Transformer

  model_cfg = config_lib.to_model_config(c).for_decoding()
  mesh = sharding.mesh_from_config(c.mesh, devices)
  row_shards = sharding.row_shards(mesh)
  if shape.rows % row_shards:
    raise config_lib.ConfigError(
      f"--rows={shape.rows} must be a multiple of the mesh's data x fsdp = {row_shards} (rows "
      "are split over them); for fewer rows use tensor parallelism, e.g. "
      f"--config.mesh.shape='(1,1,{len(devices)})'"
    )
  if shape.refill and shape.queue < 1:
    raise config_lib.ConfigError(f"--queue={shape.queue}: a refill decode needs a prompt queued")
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  abstract = sharding.with_shardings(
    abstract, sharding.state_shardings(abstract, mesh, sharding.SAMPLING_RULES)
  )
  settings = decode_settings(c, shape)

  def rows_of(dtype, *dims):
    spec = sharding.batch_sharding(mesh, 1 + len(dims))
    return jax.ShapeDtypeStruct((shape.rows, *dims), dtype, sharding=spec)

  def replicated(dtype, *dims):
    return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding.replicated(mesh))

  seed, gamma = replicated(jnp.uint32), replicated(jnp.float32)
  kwargs = dict(
    settings=settings,
    model_cfg=model_cfg,
    cache_length=settings.cache_slots(shape.prompt_len, shape.rows),
    mesh=mesh,
  )
  weights = (decode_loop.StaticGraph.of(graphdef, abstract), jax.tree.leaves(abstract))
  start = time.perf_counter()
  if shape.refill:
    prompts = (
      replicated(jnp.int32, shape.queue, shape.prompt_len),
      replicated(jnp.int32, shape.queue),
    )
    queued = replicated(jnp.int32)
    lowered = decode_queue.decode_queue.lower(
      *weights, *prompts, queued, seed, gamma, rows=shape.rows, **kwargs
    )
  else:
    prompts = (rows_of(jnp.int32, shape.prompt_len), rows_of(jnp.int32), rows_of(jnp.bool_))
    batch_index = replicated(jnp.int32)
    lowered = decode_loop.decode_batch.lower(*weights, *prompts, seed, batch_index, gamma, **kwargs)
  compiled = lowered.compile()
  return compiled, count_params(abstract), time.perf_counter() - start


def cache_layer_copies(hlo_text: str, cache_slots: int, rows: int, in_loops: bool = False) -> int:
  """Copy ops in a compiled decode whose result is a whole KV-cache layer on a device
  ([rows, slots, kv_heads, head_dim], or [rows, kv_heads, slots, head_dim] heads-first, with
  `rows` the rows a device holds): layout changes or duplicates of the cache that an in-place
  update does not need. A copy of fewer rows (a refill's new rows changing layout on their way
  in) is not one. With `in_loops`, only those outside the entry computation (in a while loop's
  body or condition), which run once per iteration rather than once per call."""
  s = cache_slots
  layer = re.compile(rf"= \w+\[({rows},{s},\d+,\d+|{rows},\d+,{s},\d+)\]\S* copy\(")
  copies, entry = 0, False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):  # a computation's header
      entry = line.startswith("ENTRY")
    elif layer.search(line) and not (in_loops and entry):
      copies += 1
  return copies


def report(
  c,
  topology: str,
  step_time_s: float = 0.0,
  decode: DecodeShape | None = None,
  num_slices: int = 1,
) -> dict:
  """Compile the train step of config `c` (or, given `decode`, the decode loop) for
  `num_slices` slices of `topology` and describe memory and FLOPs."""
  generation, topology_name = parse_topology(topology)
  devices = topology_devices(topology_name, num_slices)
  mesh = sharding.mesh_from_config(c.mesh, devices)
  chip = CHIPS[generation]
  chips = num_slices * math.prod(int(s) for s in topology_name.split(":")[1].split("x"))
  device_hbm = chip.hbm_bytes * chips // len(devices)
  device_flops = chip.peak_flops * chips / len(devices)
  header = {
    "program": "train" if decode is None else "decode",
    "topology": topology_name if num_slices == 1 else f"{num_slices} x {topology_name}",
    "devices": len(devices),
    "device_kind": devices[0].device_kind,
    "mesh": dict(mesh.shape),
    "batch_size": c.train.batch_size,
    "seq_len": c.train.seq_len,
    "loss_chunk": c.train.loss_chunk,
    "remat": c.model.remat,
    "scan_layers": bool(c.model.scan_layers),
    "hbm_per_device": device_hbm,
  }
  if decode is not None:
    header.update(decode=dataclasses.asdict(decode))
  try:
    if decode is None:
      compiled, n_params, compile_s = compile_train_step(c, devices)
    else:
      compiled, n_params, compile_s = compile_decode(c, devices, decode)
  except jax.errors.JaxRuntimeError as e:
    if "out of memory" not in str(e).lower():
      raise
    # The TPU compiler itself refuses programs that cannot fit; keep its one-line reason.
    reason = next((line for line in str(e).splitlines() if "memory" in line.lower()), str(e))
    return {**header, "fits": False, "compiler_error": " ".join(reason.split())}
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
  temporaries, aliased = memory.temp_size_in_bytes, memory.alias_size_in_bytes
  total = arguments + outputs - aliased + temporaries  # donated state is counted once
  flops = float(cost.get("flops", 0.0))
  if decode is None:
    # XLA counts a loop body once, so with scanned layers its count covers one layer; MFU and
    # time at peak use the model's FLOPs (6 N per token plus attention, remat not counted).
    tokens_per_device = 2 * c.train.seq_len * c.train.batch_size / len(devices)
    model_cfg = config_lib.to_model_config(c)
    flops = flops_per_token(model_cfg, n_params, c.train.seq_len) * tokens_per_device
    xla_flops = float(cost.get("flops", 0.0))
  else:
    xla_flops = flops
  estimate_s = max(float(cost.get("optimal_seconds", 0.0)), 0.0)  # < 0: no estimate
  out = {
    **header,
    "params": n_params,
    "compile_s": round(compile_s, 1),
    "bytes_per_device": {
      "arguments": arguments,
      "outputs": outputs,
      "aliased": aliased,
      "temporaries": temporaries,
      "total": total,
    },
    "fits": total <= device_hbm,
    # train: the model's FLOPs; decode: XLA's count, in which the while loop's body (one
    # forward) appears once.
    "flops_per_device": flops,
    "xla_flops_per_device": xla_flops,
    "seconds_at_peak": flops / device_flops if device_flops else None,
    "xla_estimated_seconds": estimate_s or None,
  }
  if decode is not None:
    slots = decode_settings(c, decode).cache_slots(decode.prompt_len, decode.rows)
    hlo = compiled.as_text()
    rows = decode.rows // sharding.row_shards(mesh)  # on a device
    out["cache_layer_copies"] = cache_layer_copies(hlo, slots, rows)
    out["cache_layer_copies_in_loops"] = cache_layer_copies(hlo, slots, rows, in_loops=True)
  if step_time_s > 0:
    out["step_time_s"] = step_time_s
    out["mfu_at_step_time"] = flops / (step_time_s * device_flops)
  return out


def format_report(r: dict) -> str:
  gib = 2**30
  place = f"on {r['topology']} ({r['devices']} x {r['device_kind']}), mesh {r['mesh']}"
  if r["program"] == "train":
    setup = (
      f"{place}, batch {r['batch_size']} x {r['seq_len']} (SBD input 2 x {r['seq_len']}), "
      f"loss_chunk {r['loss_chunk']}, remat {r['remat']}, scan_layers {r.get('scan_layers', False)}"
    )
  else:
    d = r["decode"]
    schedule = ""
    if d["mode"] == "sbd" and d["rows"] > 1:
      schedule = ", lockstep" if d["lockstep"] else ", rows alone"
    if d.get("refill"):
      schedule += f", a queue of {d['queue']} prompts, rows refilled {d['refill_rows']} at a time"
    setup = (
      f"{place}, {d['mode'].upper()} decode of {d['rows']} rows, prompt {d['prompt_len']} + "
      f"{d['max_new_tokens']} new tokens (block {d['block_size']}{schedule})"
    )
  if "compiler_error" in r:
    return (
      f"{PROGRAMS[r['program']]} {setup}: DOES NOT FIT; the compiler says: {r['compiler_error']}"
    )
  b = r["bytes_per_device"]
  lines = [
    f"{r['program']} of {r['params'] / 1e6:,.1f}M params {setup}; compiled in {r['compile_s']} s",
    f"per device: arguments {b['arguments'] / gib:.2f} GiB + outputs {b['outputs'] / gib:.2f} "
    f"GiB - donated {b['aliased'] / gib:.2f} GiB + temporaries {b['temporaries'] / gib:.2f} GiB "
    f"= {b['total'] / gib:.2f} GiB of {r['hbm_per_device'] / gib:.1f} GiB HBM: "
    + ("fits" if r["fits"] else "DOES NOT FIT"),
    (
      f"model FLOPs per device per step: {r['flops_per_device']:.3e}"
      f" (XLA counts {r.get('xla_flops_per_device', 0.0):.3e}, a scanned layer once)"
      if r["program"] == "train"
      else f"FLOPs per device (XLA counts a while loop's body once): {r['flops_per_device']:.3e}"
    )
    + (f" ({r['seconds_at_peak']:.3g} s at peak)" if r["seconds_at_peak"] else "")
    + (
      f"; XLA's estimate {r['xla_estimated_seconds']:.3g} s" if r["xla_estimated_seconds"] else ""
    ),
  ]
  if "cache_layer_copies" in r:
    copies, in_loops = r["cache_layer_copies"], r.get("cache_layer_copies_in_loops")
    where = "" if in_loops is None else f" ({in_loops} inside its loops, the rest once per call)"
    lines.append(f"copies of a KV-cache layer in the program: {copies}{where}")
    d = r["decode"]
    if copies and d["mode"] == "sbd" and d["rows"] > 1 and not d["lockstep"]:
      lines.append(
        "  (rows moving alone write the cache at per-row offsets, which this compiler lays out "
        "apart from attention, e.g. at a head_dim below 128: compare with --lockstep)"
      )
  if "mfu_at_step_time" in r:
    lines.append(f"MFU at a {r['step_time_s']} s step: {100 * r['mfu_at_step_time']:.1f} %")
  return "\n".join(lines)


def no_fit_reason(r: dict) -> str:
  if "compiler_error" in r:
    return f"the {PROGRAMS[r['program']]} does not fit on {r['device_kind']}: {r['compiler_error']}"
  need, have = r["bytes_per_device"]["total"] / 2**30, r["hbm_per_device"] / 2**30
  fixes = (
    "shorten train.seq_len, lower train.batch_size, or set model.remat / train.loss_chunk"
    if r["program"] == "train"
    else "lower --rows, --prompt_len or --max_new_tokens"
  )
  return (
    f"the {PROGRAMS[r['program']]} needs {need:.1f} GiB per device, more than the {have:.1f} GiB of HBM "
    f"of {r['device_kind']}; shard over more chips, {fixes}"
  )


def _define_flags():
  """CLI flags, defined only when run as a script (so the module imports as a library)."""
  config_flags.DEFINE_config_file("config", None, "Experiment config file.")
  flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-16, v6e-8, v5p:2x2x4.")
  flags.DEFINE_integer(
    "num_slices", 1, "Slices of --topology joined by the data-centre network (multislice)."
  )
  flags.DEFINE_float("step_time_s", 0.0, "Report the MFU this step time implies.")
  flags.DEFINE_bool("json", False, "Print the report as JSON.")
  flags.DEFINE_enum("mode", "train", ["train", "decode"], "Program to compile.")
  flags.DEFINE_integer("rows", 8, "decode: rows per batch.")
  flags.DEFINE_integer("prompt_len", 2048, "decode: prompt slots.")
  flags.DEFINE_integer("max_new_tokens", 512, "decode: generated tokens.")
  flags.DEFINE_integer("block_size", 16, "decode: SBD block size.")
  flags.DEFINE_enum("decode_mode", "sbd", ["sbd", "ntp"], "decode: SBD or NTP.")
  flags.DEFINE_bool("lockstep", False, "decode: SBD rows in lockstep (default: alone).")
  flags.DEFINE_bool("refill", False, "decode: a queue of prompts, finished rows refilled.")
  flags.DEFINE_integer("queue", 64, "decode with --refill: prompts queued.")
  flags.DEFINE_integer("refill_rows", 1, "decode with --refill: rows refilled together.")
  flags.mark_flags_as_required(["config", "topology"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    decode = None
    for name in ("queue", "refill_rows"):
      if f[name].present and not (f.refill and f.mode == "decode"):
        raise config_lib.ConfigError(f"--{name} applies to --mode=decode --refill")
    if f.mode == "decode":
      decode = DecodeShape(
        f.rows, f.prompt_len, f.max_new_tokens, f.block_size, f.decode_mode, f.lockstep,
        f.refill, f.queue, f.refill_rows,
      )  # fmt: skip
    r = report(f.config, f.topology, f.step_time_s, decode, f.num_slices)
  except (config_lib.ConfigError, ValueError) as e:
    cli.fail(e)
  print(json.dumps(r, indent=2) if f.json else format_report(r))
  if not r["fits"]:
    print(f"error: {no_fit_reason(r)}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
