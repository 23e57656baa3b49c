"""Scalars for dashboards: TensorBoard event files in <workdir>/tensorboard (watch a run with
`tensorboard --logdir <workdir>`), and Weights & Biases when `wandb` is installed and
`train.wandb_project` names a project.

Events are written with TensorBoard's own writer and protos, so nothing here needs TensorFlow.
In a bucket (gs://, through fsspec) the event file is rewritten whole at each flush: an object
cannot be appended to, and gcsfs turns TensorBoard's appends into overwrites that keep only the
last record. Non-finite values (e.g. MFU on a device whose peak is unknown) are left out.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from sbd_jax import paths

TENSORBOARD_DIR = "tensorboard"
_file_ids = itertools.count()  # event files of one process opened within the same second differ


def wandb_run_id(workdir: str) -> str:
  """A stable id per workdir, so a resumed run appends to its W&B run instead of forking."""
  where = workdir if paths.is_remote(workdir) else os.path.abspath(workdir)
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

    remote = paths.is_remote(workdir)
    logdir = os.path.join(workdir, TENSORBOARD_DIR)
    try:
      self._events = _BucketEventFile(logdir) if remote else EventFileWriter(logdir)
    except (ImportError, ValueError) as e:
      if not remote:
        raise
      # A bucket TensorBoard cannot open (gs:// needs gcsfs, in the [tpu] extra): the run goes
      # on, with metrics.jsonl and checkpoints, and says so once.
      logging.warning("no TensorBoard events in %s: %s", workdir, " ".join(str(e).split()))
    if wandb_project:
      self._wandb = require_wandb().init(
        project=wandb_project,
        id=wandb_run_id(workdir),
        name=os.path.basename(workdir.rstrip("/") if remote else os.path.abspath(workdir)),
        dir=None if remote else workdir,  # wandb stages its files locally
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


class _BucketEventFile:
  """An event file in a bucket, rewritten whole at each flush (an object cannot be appended
  to); what EventFileWriter writes locally, with the same file name pattern."""

  def __init__(self, logdir: str):
    import fsspec
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    fs, root = fsspec.core.url_to_fs(logdir)  # ValueError / ImportError: no such filesystem
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
    self._fs, self._path = fs, f"{root.rstrip('/')}/{name}.{next(_file_ids)}"
    self._buffer = io.BytesIO()
    self._records = RecordWriter(self._buffer)
    self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
    self.flush()  # an unwritable bucket fails here, before training starts

  def add_event(self, event) -> None:
    self._records.write(event.SerializeToString())

  def flush(self) -> None:
    self._fs.pipe_file(self._path, self._buffer.getvalue())

  def close(self) -> None:
    self.flush()
