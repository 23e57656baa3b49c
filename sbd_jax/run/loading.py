"""A trained workdir's model, loaded to sample from: the run's config rebuilt abstractly, its
params export restored into it (sharded for sampling on a mesh), its tokenizer and mask id.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from sbd_jax import compile_cache, paths, sharding
from sbd_jax import config as config_lib
from sbd_jax.data.tokenizer import Tokenizer, load_tokenizer
from sbd_jax.decode.sampler import SamplingModel
from sbd_jax.model.transformer import Transformer
from sbd_jax.run import checkpointing
from sbd_jax.run.workdir import read_trained_config


def decode_mesh(config: ml_collections.ConfigDict, devices) -> Mesh:
  """The mesh a run decodes on over `devices`: `sample.mesh_shape`, by default the decoding
  layout (`sharding.decoding_mesh_shape`)."""
  shape = tuple(config.sample.get("mesh_shape", ()))  # a run saved before the field: default
  return sharding.decoding_mesh(devices, config.model.num_kv_heads, shape)


def mesh_for(config: ml_collections.ConfigDict) -> Mesh | None:
  """`decode_mesh` over every device when there is more than one, else None (one device)."""
  return decode_mesh(config, jax.devices()) if jax.device_count() > 1 else None


def load_sampling_model(
  workdir: str,
  mesh: Mesh | None = None,
  attention_impl: str = "dense",
  compute_dtype: str | None = None,
) -> tuple[SamplingModel, ml_collections.ConfigDict, Tokenizer, int]:
  """(SamplingModel, config, tokenizer, mask_id) of a training workdir's <workdir>/params export.

  The model is built abstractly (`nnx.eval_shape`) and the params restored into it, sharded with
  SAMPLING_RULES when a mesh is given. Decode forwards are short, so attention defaults to the
  dense implementation. The run's compilation cache (`compile_cache`) serves the decodes too.
  `compute_dtype` (e.g. "bfloat16") replaces the run's: weights are stored in it to decode.
  """
  config = read_trained_config(workdir)
  if compute_dtype is not None:
    config.model.compute_dtype = compute_dtype
  compile_cache.enable_for_run(config, workdir)
  tokenizer = load_tokenizer(config.tokenizer, workdir)
  mask_id = config_lib.resolve_mask_id(config, tokenizer)
  path = str(paths.resolve(workdir) / checkpointing.PARAMS_DIR)
  model = sampling_model_from_params(
    config,
    lambda abstract: checkpointing.load_params(path, abstract),
    mesh=mesh,
    attention_impl=attention_impl,
  )
  return model, config, tokenizer, mask_id


def sampling_model_from_params(
  config: ml_collections.ConfigDict,
  params_of: Callable[[nnx.State], nnx.State],
  mesh: Mesh | None = None,
  attention_impl: str = "dense",
) -> SamplingModel:
  """A SamplingModel of the run `config` describes, its params `params_of(abstract params)`:
  restored from a checkpoint, or the training state's own (a held-out decode while training),
  placed on the abstract params' shardings (SAMPLING_RULES on `mesh`, when given)."""
  cfg = config_lib.to_model_config(config).for_decoding().replace(attention_impl=attention_impl)

  def create():
    return Transformer(cfg, rngs=nnx.Rngs(0))

  graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(create), nnx.Param, ...)
  if mesh is not None:
    shardings = sharding.state_shardings(abstract_params, mesh, sharding.SAMPLING_RULES)
    abstract_params = jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract_params, shardings
    )
  params = params_of(abstract_params)
  # Non-parameter state (RoPE tables): computed by a jitted init whose params are dead code.
  rest = jax.jit(lambda: nnx.split(create(), nnx.Param, ...)[2])()
  return SamplingModel.of(nnx.merge(graphdef, params, rest))
