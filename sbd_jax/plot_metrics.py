"""CLI: plot a run's metrics.jsonl (both loss terms and the learning rate).

python -m sbd_jax.plot_metrics --workdir=DIR [--out=FILE.png]
"""

from __future__ import annotations

import os

from absl import flags

from sbd_jax import cli
from sbd_jax.training import metrics_plot

flags.DEFINE_string("workdir", None, "Training workdir holding metrics.jsonl.")
flags.DEFINE_string("out", None, "Output PNG; default <workdir>/metrics.png.")
flags.mark_flag_as_required("workdir")


def main(argv):
  del argv
  workdir, out = flags.FLAGS.workdir, flags.FLAGS.out
  try:
    path = metrics_plot.plot(
      metrics_plot.read_metrics(workdir), out or os.path.join(workdir, "metrics.png")
    )
  except FileNotFoundError as e:
    cli.fail(e)
  print(path)


if __name__ == "__main__":
  cli.run(main)
