"""A run's metrics.jsonl read back (the last record of a step wins) and drawn as loss curves."""

from __future__ import annotations

import io
import json
import os

from etils import epath

from sbd_jax.training.metrics import METRICS_FILE


def read_metrics(workdir: str) -> list[dict]:
  """Records of metrics.jsonl, one per step: a step's training and held-out records merged;
  for steps logged twice (before a crash and after resume) the last values win."""
  path = os.path.join(workdir, METRICS_FILE)
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"{path} not found")
  by_step = {}
  for line in epath.Path(path).read_text().splitlines():
    record = json.loads(line)
    by_step.setdefault(record["step"], {}).update(record)
  return [by_step[s] for s in sorted(by_step)]


def _heldout_keys(records: list[dict]) -> list[str]:
  """The held-out losses logged (`training.heldout`), in first-seen order."""
  keys = {k: None for r in records for k in r if k.startswith("heldout/") and "_loss" in k}
  return list(keys)


def _plot_heldout(ax, records: list[dict], keys: list[str]) -> None:
  for key in keys:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    name = key.removeprefix("heldout/")
    label = "NTP" if name == "ntp_loss" else f"MATP, mask rate {name.rsplit('mask', 1)[-1]}"
    ax.plot(*zip(*points), marker="o", label=label)
  ax.set(xlabel="step", ylabel="loss per target token", title="held-out")
  ax.legend()


def plot(records: list[dict], out: str) -> str:
  """The training loss terms, the learning rate and, when evaluated, the held-out losses
  (NTP, and MATP per masked token at each masking rate)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  heldout_keys = _heldout_keys(records)
  training = [r for r in records if "loss" in r]
  steps = [r["step"] for r in training]
  panels = 3 if heldout_keys else 2
  fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
  ax_loss, ax_lr = axes[0], axes[1]
  if heldout_keys:
    _plot_heldout(axes[2], records, heldout_keys)
  for key, label in [("loss", "total"), ("ntp_loss", "NTP term"), ("matp_loss", "MATP term")]:
    ax_loss.plot(steps, [r[key] for r in training], label=label)
  ax_loss.set(xlabel="step", ylabel="loss (per NTP target)", title="SBD training loss")
  ax_loss.legend()
  ax_lr.plot(steps, [r["lr"] for r in training], color="tab:gray")
  ax_lr.set(xlabel="step", ylabel="learning rate", title="schedule")
  fig.tight_layout()
  image = io.BytesIO()  # drawn in memory, then written whole: a local file or one in a bucket
  fig.savefig(image, format="png", dpi=120)
  epath.Path(out).write_bytes(image.getvalue())
  plt.close(fig)
  return out
