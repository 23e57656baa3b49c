"""Scalars for dashboards: TensorBoard event files in <workdir>/tensorboard (watch a run with
`tensorboard --logdir <workdir>`), and Weights & Biases when `wandb` is installed and
`train.wandb_project` names a project.

Events are written with TensorBoard's own writer and protos, so nothing here needs TensorFlow.
Non-finite values (e.g. MFU on a device whose peak is unknown) are left out.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

TENSORBOARD_DIR = "tensorboard"


def wandb_run_id(workdir: str) -> str:
  """A stable id per workdir, so a resumed run appends to its W&B run instead of forking."""
  where = workdir if "://" in workdir else os.path.abspath(workdir)
  return hashlib.sha1(where.encode()).hexdigest()[:16]


def require_wandb():
  """The `wandb` module, or a one-line error saying how to get it."""
  try:
    import wandb  # pylint: disable=g-import-not-at-top  (optional dependency)
  except ImportError:
    raise ImportError(
      "train.wandb_project is set but wandb is not installed: pip install wandb, or unset it"
    ) from None
  return wandb


class Dashboards:
  """Writes `{tag: value}` scalars at a step to TensorBoard and, if configured, to W&B."""

  def __init__(
    self,
    workdir: str,
    *,
    wandb_project: str = "",
    config: Mapping[str, Any] | None = None,
    enabled: bool = True,
  ):
    self._events = self._wandb = None
    if not enabled:
      return
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    try:
      self._events = EventFileWriter(os.path.join(workdir, TENSORBOARD_DIR))
    except (ImportError, ValueError) as e:
      if "://" not in workdir:
        raise
      # A bucket TensorBoard cannot open (gs:// needs gcsfs, in the [tpu] extra): the run goes
      # on, with metrics.jsonl and checkpoints, and says so once.
      logging.warning("no TensorBoard events in %s: %s", workdir, " ".join(str(e).split()))
    if wandb_project:
      self._wandb = require_wandb().init(
        project=wandb_project,
        id=wandb_run_id(workdir),
        name=os.path.basename(
          workdir.rstrip("/") if "://" in workdir else os.path.abspath(workdir)
        ),
        dir=workdir,
        config=dict(config or {}),
        resume="allow",
      )

  def scalars(self, step: int, values: Mapping[str, Any], prefix: str) -> None:
    """Log the finite numeric `values` as `<prefix>/<name>` at `step`."""
    if self._events is None:
      return
    from tensorboard.compat.proto import event_pb2, summary_pb2

    finite = {
      f"{prefix}/{k}": float(v)
      for k, v in values.items()
      if isinstance(v, (int, float)) and math.isfinite(v)
    }
    summary = summary_pb2.Summary(
      value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in finite.items()]
    )
    self._events.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary))
    self._events.flush()
    if self._wandb is not None:
      self._wandb.log(finite, step=step)

  def close(self) -> None:
    if self._events is not None:
      self._events.close()
      self._events = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None
