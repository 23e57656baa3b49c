"""Training metrics: a JSONL file (plotted by `python -m sbd_jax.plot_metrics`), log lines, a
progress bar, and FLOP estimates for MFU."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, Callable

import jax
from tqdm import tqdm

from sbd_jax import paths
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.training.dashboards import Dashboards

METRICS_FILE = "metrics.jsonl"

# Dense bf16 peak FLOP/s per chip, by `device_kind` prefix (public spec sheets).
_PEAK_FLOPS = {
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,
  "TPU v5e": 197e12,
  "TPU v5p": 459e12,
  "TPU v5": 459e12,
  "TPU v6": 918e12,
  "NVIDIA H100": 989e12,
  "NVIDIA H200": 989e12,
  "NVIDIA A100": 312e12,
}


def peak_flops_per_device() -> float:
  """Peak FLOP/s of this device kind, or 0.0 when unknown (e.g. CPU: MFU is then not shown)."""
  kind = jax.devices()[0].device_kind
  for prefix, flops in sorted(_PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
    if kind.startswith(prefix):
      return flops
  return 0.0


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int) -> float:
  """Training FLOPs per processed token of rows of `seq_len` (L) tokens: 6 per parameter that
  multiplies (fwd + bwd; an untied input embedding is a lookup, not counted; tied, the table
  counts once, as the output projection) plus attention scores and values, 12 * layers *
  heads * head_dim * L / 2. A query sees L / 2 keys on average both in a causal row and in the
  SBD input's 2L tokens (a clean query its causal past; a block query the clean past before
  its block, plus the block), so the SBD step's extra attention is in its token count, not in
  this figure. Rematerialisation is not counted (model FLOPs, as MFU counts them)."""
  lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim
  attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len / 2
  return 6 * (n_params - lookup) + attention


class _JsonlAppender:
  """Appends lines to a local file, or to a remote one (gs://...) that cannot be appended to
  in place: there the whole file is rewritten after each line (a log of ~1k lines)."""

  def __init__(self, path: str):
    self._path = paths.resolve(path)
    self._remote = paths.is_remote(path)
    if self._remote:
      self._lines = self._path.read_text().splitlines() if self._path.exists() else []
    else:
      self._file = open(self._path, "a")

  def append(self, line: str) -> None:
    if self._remote:
      self._lines.append(line)
      self._path.write_text("\n".join(self._lines) + "\n")
    else:
      self._file.write(line + "\n")
      self._file.flush()

  def close(self) -> None:
    if not self._remote:
      self._file.close()


class MetricsLogger:
  """Appends metric records to <workdir>/metrics.jsonl, prints a compact line per record and
  passes the scalars on to `dashboards` (TensorBoard, W&B) under `train/`."""

  def __init__(
    self,
    workdir: str,
    *,
    total_steps: int,
    start_step: int,
    enabled: bool = True,
    progress_bar: bool = True,
    dashboards: Dashboards | None = None,
  ):
    self.enabled = enabled
    self._dashboards = dashboards
    self.path = str(paths.resolve(workdir) / METRICS_FILE)
    self._file = _JsonlAppender(self.path) if enabled else None
    show_bar = enabled and progress_bar and sys.stderr.isatty()
    self._bar = tqdm(
      total=total_steps, initial=start_step, disable=not show_bar, dynamic_ncols=True, desc="train"
    )
    self._log = logging.getLogger("sbd_jax.train")

  def info(self, message: str) -> None:
    if self.enabled:
      self._write_line(message)

  def advance(self, step: int) -> None:
    self._bar.update(step - self._bar.n)

  def log(self, step: int, values: dict[str, Any]) -> None:
    if not self.enabled:
      return
    # NaN (e.g. MFU on a device of unknown peak) is written as null: strict JSON.
    record = {"step": step, **{k: None if v != v else v for k, v in values.items()}}
    self._file.append(json.dumps(record))
    if self._dashboards is not None:
      self._dashboards.scalars(step, values, prefix="train")
    mfu, tokens_per_s = values.get("mfu", math.nan), values["tokens_per_s"]
    line = (
      f"step {step:6d} | loss {values['loss']:.4f} | ntp {values['ntp_loss']:.4f} | "
      f"matp {values['matp_loss']:.4f} | lr {values['lr']:.2e}"
      + (f" | {tokens_per_s:,.0f} tok/s" if math.isfinite(tokens_per_s) else "")
      + (f" | mfu {mfu:.1%}" if math.isfinite(mfu) else "")
    )
    self._bar.set_postfix(loss=f"{values['loss']:.3f}")
    self._write_line(line)

  def log_heldout(self, step: int, values: dict[str, float]) -> None:
    """A held-out evaluation (`training.heldout`): a record of `heldout/<name>` values in
    metrics.jsonl, the scalars under `heldout/` on the dashboards, and one line."""
    if not self.enabled:
      return
    self._file.append(json.dumps({"step": step, **{f"heldout/{k}": v for k, v in values.items()}}))
    if self._dashboards is not None:
      self._dashboards.scalars(step, values, prefix="heldout")
    self._write_line(
      f"step {step:6d} | held-out | " + " | ".join(f"{k} {v:.4g}" for k, v in values.items())
    )

  def _write_line(self, line: str) -> None:
    if self._bar.disable:
      print(line, flush=True)
    else:
      self._bar.write(line)

  def close(self) -> None:
    self._bar.close()
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._dashboards is not None:
      self._dashboards.close()
      self._dashboards = None


class Throughput:
  """Tokens per second and MFU over the steps since the last log line. The first window
  starts when the first (compiling) step has finished. Each step states what it processed,
  so phases of different cost (NTP pretraining, then SBD) are counted right."""

  def __init__(self, peak_flops: float):
    self.peak = peak_flops
    self.start, self.tokens, self.processed, self.flops = None, 0, 0, 0.0

  def add(self, real_tokens: int, processed_tokens: int, flops_per_token: float) -> None:
    self.tokens += real_tokens
    self.processed += processed_tokens
    self.flops += processed_tokens * flops_per_token

  def started(self) -> bool:
    return self.start is not None

  def restart(self) -> None:
    self.start, self.tokens, self.processed, self.flops = time.perf_counter(), 0, 0, 0.0

  def read_and_restart(self) -> dict[str, float]:
    now = time.perf_counter()
    elapsed = now - self.start if self.start is not None else math.nan
    peak = self.peak * jax.device_count()
    out = {
      "tokens_per_s": self.tokens / elapsed,
      "processed_tokens_per_s": self.processed / elapsed,
      "mfu": self.flops / elapsed / peak if self.peak else math.nan,
    }
    self.start, self.tokens, self.processed, self.flops = now, 0, 0, 0.0
    return out


class MetricWindow:
  """Per-step metrics fetched one step late (so the host never waits on the device), checked for
  NaN/Inf, and averaged over the steps since the previous log line.

  A non-finite step stops the run (FloatingPointError, before anything saves the state), unless
  its update was skipped on the device (`train.skip_nonfinite_steps`, `optim.make_optimizer`)
  and no more than `max_skipped` updates have been skipped so far: then it is logged and left
  out of the averages.
  """

  def __init__(
    self,
    logger: MetricsLogger,
    schedule,
    max_skipped: int = 0,
    counters: Callable[[], dict[str, float]] | None = None,
  ):
    self.logger, self.schedule, self.max_skipped = logger, schedule, max_skipped
    self.counters = counters  # host-side totals logged with every record (skipped records)
    self.sums: dict[str, float] = {}
    self.steps = 0
    self.last: dict[str, float] = {}

  def finish(self, step: int, metrics, perf: dict[str, float] | None) -> dict[str, float]:
    """Account for `step`'s metrics; at log steps (`perf` given) log and return the means."""
    fetched = {k: float(v) for k, v in jax.device_get(metrics).items()}
    update_skipped = bool(fetched.pop("update_skipped", False))
    total_skipped = int(fetched.pop("skipped_updates", 0))
    bad = [k for k in ("ntp_loss", "matp_loss", "grad_norm") if not math.isfinite(fetched[k])]
    if bad or not math.isfinite(fetched["loss"]):
      terms = ", ".join(f"{k} = {fetched[k]}" for k in bad) or f"loss = {fetched['loss']}"
      if not (update_skipped and total_skipped <= self.max_skipped):
        self.logger.close()
        budget = (
          f" after {total_skipped - 1} skipped updates (train.skip_nonfinite_steps="
          f"{self.max_skipped})"
          if update_skipped
          else ""
        )
        raise FloatingPointError(
          f"non-finite {terms} at step {step + 1}{budget}; stopping without saving this state "
          "(earlier checkpoints are kept)"
        )
      self.logger.info(
        f"step {step + 1}: non-finite {terms}; update skipped ({total_skipped} of "
        f"train.skip_nonfinite_steps={self.max_skipped})"
      )
    else:
      self.steps += 1
      for k, v in fetched.items():
        self.sums[k] = self.sums.get(k, 0.0) + v
    self.logger.advance(step + 1)
    if perf is None:
      return self.last or {"loss": fetched["loss"]}
    if self.steps:  # a window of skipped steps only has nothing to average
      values = {k: v / self.steps for k, v in self.sums.items()}
      values.update(perf, lr=float(self.schedule(step)))
      if self.max_skipped:
        values["skipped_updates"] = total_skipped
      if self.counters is not None:
        values.update(self.counters())
      self.logger.log(step + 1, values)
      self.last = values
    self.sums, self.steps = {}, 0
    return self.last
