"""CLI: python -m sbd_jax.train --config=configs/tiny.py --workdir=DIR [--config.a.b=value]."""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from sbd_jax import cli
from sbd_jax import config as config_lib

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Path to a get_config() file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and exports go here.")
_EVALUATE = flags.DEFINE_bool(
  "evaluate",
  True,
  "After training on the arithmetic task, decode "
  "held-out problems with NTP and SBD and print accuracy / speedup.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from sbd_jax import distributed  # after flag parsing: jax.distributed first
  from sbd_jax.data.sources import DataError
  from sbd_jax.evals import while_training
  from sbd_jax.training import trainer

  distributed.maybe_initialize()
  try:
    last = trainer.train(_CONFIG.value, _WORKDIR.value, decode_eval=while_training.decoder)
  except (config_lib.ConfigError, DataError, FileNotFoundError, FloatingPointError) as e:
    cli.fail(e)
  if "stopped_at" in last:
    return  # preempted or out of time: exit 0, the next launch resumes
  c = _CONFIG.value
  if _EVALUATE.value and c.data.source == "arithmetic" and c.sample.num_problems > 0:
    from sbd_jax.evals import workdir_eval

    workdir_eval.report_after_training(_WORKDIR.value, _CONFIG.value)


if __name__ == "__main__":
  cli.run(main)
