"""Plot a run's metrics.jsonl: python -m sbd_jax.plot_metrics --workdir=DIR [--out=FILE.png]."""

from __future__ import annotations

import json
import os

from absl import flags

from sbd_jax import cli
from sbd_jax.training.metrics import METRICS_FILE


def read_metrics(workdir: str) -> list[dict]:
  """Records of metrics.jsonl; for steps logged twice (before a crash and after resume) the
  last record wins."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found")
  by_step = {}
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      by_step[record["step"]] = record
  return [by_step[s] for s in sorted(by_step)]


def plot(records: list[dict], out: str) -> str:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [r["step"] for r in records]
  fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
  for key, label in [("loss", "total"), ("ntp_loss", "NTP term"), ("matp_loss", "MATP term")]:
    ax_loss.plot(steps, [r[key] for r in records], label=label)
  ax_loss.set(xlabel="step", ylabel="loss (per NTP target)", title="SBD training loss")
  ax_loss.legend()
  ax_lr.plot(steps, [r["lr"] for r in records], color="tab:gray")
  ax_lr.set(xlabel="step", ylabel="learning rate", title="schedule")
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def main(argv):
  del argv
  workdir, out = flags.FLAGS.workdir, flags.FLAGS.out
  try:
    path = plot(read_metrics(workdir), out or os.path.join(workdir, "metrics.png"))
  except FileNotFoundError as e:
    cli.fail(e)
  print(path)


if __name__ == "__main__":  # flags are defined only when run as a program
  flags.DEFINE_string("workdir", None, "Training workdir holding metrics.jsonl.")
  flags.DEFINE_string("out", None, "Output PNG; default <workdir>/metrics.png.")
  flags.mark_flag_as_required("workdir")
  cli.run(main)
