"""A run's metrics.jsonl read back (the last record of a step wins) and drawn as loss curves."""

from __future__ import annotations

import io
import json
import os

from etils import epath

from sbd_jax.training.metrics import METRICS_FILE


def read_metrics(workdir: str) -> list[dict]:
  """Records of metrics.jsonl; for steps logged twice (before a crash and after resume) the
  last record wins."""
  path = os.path.join(workdir, METRICS_FILE)
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"{path} not found")
  by_step = {}
  for line in epath.Path(path).read_text().splitlines():
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
  image = io.BytesIO()  # drawn in memory, then written whole: a local file or one in a bucket
  fig.savefig(image, format="png", dpi=120)
  epath.Path(out).write_bytes(image.getvalue())
  plt.close(fig)
  return out
