"""The real programs, lowered and compiled ahead of time for a device list (a TPU slice
described on a CPU): the train step and the decode loop, from abstract shapes only.
"""

from __future__ import annotations

import dataclasses
import re
import time
import types

import jax
import jax.numpy as jnp

from sbd_jax import config as config_lib
from sbd_jax import sharding
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.model.transformer import count_params
from sbd_jax.run.loading import decode_mesh
from sbd_jax.training import optim
from sbd_jax.training.state import make_state_spec
from sbd_jax.training.step import make_train_step


def abstract_batch(c, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  shape = (c.train.batch_size, c.train.seq_len)
  spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.batch_sharding(mesh))
  return {k: spec for k in ("tokens", "segment_ids", "positions", "loss_mask", "eos_tail")}


def compile_train_step(
  c, devices, compiler_options: dict | None = None
) -> tuple[jax.stages.Compiled, int, float]:
  """(compiled train step of the config's objective, `c.sbd.mode`; parameter count; seconds to
  compile) for `devices`, with XLA `compiler_options` (e.g. TPU flags) when given."""
  config_lib.validate(c, num_devices=len(devices))
  model_cfg = config_lib.to_model_config(c)
  mask_id = c.sbd.mask_id if c.sbd.mask_id >= 0 else model_cfg.vocab_size - 1
  obj_cfg = config_lib.to_objective_config(c, mask_id)
  mesh = sharding.mesh_from_config(c.mesh, devices)
  tx, _ = optim.make_optimizer(c.optim, c.train.steps, c.train.skip_nonfinite_steps)
  spec = make_state_spec(model_cfg, tx, mesh, c.train.seed)
  step = make_train_step(spec, obj_cfg, mesh, c.train.seed)
  step_arg = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))
  start = time.perf_counter()
  with sharding.activation_sharding(mesh):
    lowered = step.lower(spec.abstract, abstract_batch(c, mesh), step_arg)
    compiled = lowered.compile(compiler_options=compiler_options)
  return compiled, count_params(spec.abstract["model"]), time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """The array shapes of one compiled decode (its settings are a `SamplerSettings`)."""

  rows: int = 8
  prompt_len: int = 2048  # prompt slots
  queue: int = 64  # with refill: prompts queued for the rows


def decode_settings(c, **overrides) -> SamplerSettings:
  """The run's decode settings (`config.sample`, with `overrides`; `decode.settings.from_config`)
  and token ids from the config's vocabulary: what `compile_decode` compiles."""
  vocab = c.model.vocab_size
  mask_id = c.sbd.mask_id if c.sbd.mask_id >= 0 else vocab - 1
  ids = types.SimpleNamespace(eos_id=(mask_id + 1) % vocab, pad_id=(mask_id + 2) % vocab)
  return settings_lib.from_config(c.sample, ids, mask_id, **overrides)


def compile_decode(
  c, devices, shape: DecodeShape, settings: SamplerSettings
) -> tuple[jax.stages.Compiled, int, float]:
  """(compiled decode loop, parameter count, seconds to compile): the sampler's real
  `lax.while_loop` with its KV cache of prompt_len + response slots, weights placed with
  SAMPLING_RULES over the config's mesh in the dtype and layout decoding loads them in
  (`ModelConfig.for_decoding`), rows split over (data, fsdp). With `settings.refill`, the queue
  loop (`decode.queue`) of `shape.queue` prompts, held replicated."""
  from flax import nnx

  from sbd_jax.decode import compiled, policy
  from sbd_jax.decode import queue as decode_queue
  from sbd_jax.model.transformer import Transformer

  model_cfg = config_lib.to_model_config(c).for_decoding()
  mesh = decode_mesh(c, devices)
  row_shards = sharding.row_shards(mesh)
  if shape.rows % row_shards:
    raise config_lib.ConfigError(
      f"--rows={shape.rows} must be a multiple of the mesh's data x fsdp = {row_shards} (rows "
      "are split over them); for fewer rows use tensor parallelism, e.g. "
      f"--config.sample.mesh_shape='(1,1,{len(devices)})'"
    )
  if settings.refill and shape.queue < 1:
    raise config_lib.ConfigError(f"--queue={shape.queue}: a refill decode needs a prompt queued")
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  abstract = sharding.with_shardings(
    abstract, sharding.state_shardings(abstract, mesh, sharding.SAMPLING_RULES)
  )

  def rows_of(dtype, *dims):
    spec = sharding.batch_sharding(mesh, 1 + len(dims))
    return jax.ShapeDtypeStruct((shape.rows, *dims), dtype, sharding=spec)

  def replicated(dtype, *dims):
    return jax.ShapeDtypeStruct(dims, dtype, sharding=sharding.replicated(mesh))

  seed, gamma, temperature = (
    replicated(jnp.uint32),
    replicated(jnp.float32),
    replicated(jnp.float32),
  )
  # How a verified decode chooses its forwards, and the rows' token limit: traced values.
  kinds = 1 + len(settings.draft_widths)
  tuning = policy.Tuning(
    replicated(jnp.float32, kinds), replicated(jnp.float32, settings.block_size),
    replicated(jnp.int32),
    replicated(jnp.bool_),
    replicated(jnp.bool_),
  )  # fmt: skip
  limit = replicated(jnp.int32)
  kwargs = dict(
    settings=settings,
    model_cfg=model_cfg,
    cache_length=settings.cache_slots(shape.prompt_len, shape.rows),
    mesh=mesh,
  )
  weights = (compiled.StaticGraph.of(graphdef, abstract), jax.tree.leaves(abstract))
  start = time.perf_counter()
  if settings.refill:
    prompts = (
      replicated(jnp.int32, shape.queue, shape.prompt_len),
      replicated(jnp.int32, shape.queue),
    )
    queued = replicated(jnp.int32)
    lowered = decode_queue.decode_queue.lower(
      *weights,
      *prompts,
      queued,
      seed,
      gamma,
      temperature,
      tuning,
      limit,
      rows=shape.rows,
      **kwargs,
    )
  else:
    prompts = (rows_of(jnp.int32, shape.prompt_len), rows_of(jnp.int32), rows_of(jnp.bool_))
    batch_index = replicated(jnp.int32)
    lowered = compiled.decode_batch.lower(
      *weights, *prompts, seed, batch_index, gamma, temperature, tuning, limit, **kwargs
    )
  program = lowered.compile()
  return program, count_params(abstract), time.perf_counter() - start


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
