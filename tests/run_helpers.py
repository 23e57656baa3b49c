"""Shared by the tests that read a run directory: a workdir holding a config and the params of
an untrained model (what decoding, evaluation and the benchmarks read), made in a second."""

from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax.model.transformer import Transformer
from sbd_jax.run import checkpointing
from sbd_jax.run import workdir as workdir_lib


def untrained_workdir(path: str, c) -> str:
  """`path` as a run of config `c` whose params export holds its random initialisation."""
  workdir_lib.write_config(path, c)
  model = nnx.jit(lambda: Transformer(config_lib.to_model_config(c), rngs=nnx.Rngs(0)))()
  checkpointing.export_params(path, nnx.state(model, nnx.Param))
  return path
