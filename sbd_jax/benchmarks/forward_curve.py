"""time(n) / time(1) of one cached forward on this machine, per model size, dtype and batch: the
curve that decides what SBD's fewer forwards are worth in wall-clock time.

    python -m sbd_jax.benchmarks.forward_curve --out=DIR [--models=tiny,m100]
        [--dtypes=float32,bfloat16] [--batches=1,4] [--ns=1,2,4,8,16,32]
        [--cache_length=256] [--repeats=3] [--concurrent_schedule]

For each (model, dtype, batch) it times the sampler's real cached forward over n new tokens per
row (`wallclock.time_forwards`: the slope between a 1-forward and a (1 + inner)-forward call of
one compiled loop, so per-call dispatch is not counted), random weights (`decode_speed`'s
shapes). A flat curve (time(16) close to time(1)) is the memory-bound regime where revealing
several tokens per forward is nearly free; a curve rising like n is the compute-bound regime
where it is not. Also reported: the SBD speedup at r tokens per forward that the curve implies,
k time(1) / (time(2k) + (l - 1) time(k)) with k = 16 (as `tpu_time`). Programs compile with
`decode_speed`'s XLA:CPU options unless `--concurrent_schedule` (see
`decode_speed.use_xla_cpu_options`). Writes DIR/results.json, DIR/forward_curve.md and
DIR/forward_curve.png.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
from absl import flags

from sbd_jax import cli
from sbd_jax.benchmarks import decode_speed, markdown, wallclock
from sbd_jax.benchmarks.tpu_time import sbd_speedup
from sbd_jax.model.transformer import count_params

BLOCK = 16
RATES = (2.0, 4.0, 8.0)


def curve(
  name: str, dtype: str, batch: int, ns: Sequence[int], cache_length: int, repeats: int
) -> dict[str, Any]:
  """time(n) of one (model, dtype, batch), with the per-call overhead and the implied speedups."""
  model = decode_speed.random_model(decode_speed.model_config(name, dtype))
  forward = wallclock.time_forwards(
    model, batch=batch, cache_length=cache_length, ns=ns, repeats=repeats, inner=8
  )
  times = {str(n): float(t) for n, t in forward["time_s"].items()}
  out = {
    "model": name,
    "params": count_params(model.state),
    "dtype": dtype,
    "batch": batch,
    "cache_length": cache_length,
    "time_s": times,
    "ratio": {n: t / times["1"] for n, t in times.items()},
    "by_slope": forward["by_slope"],
  }
  if {"1", str(BLOCK), str(2 * BLOCK)} <= set(times):
    out["sbd_speedup"] = {str(r): sbd_speedup(times, BLOCK, r) for r in RATES}
  return out


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  ns = sorted({int(n) for r in rows for n in r["time_s"]})
  header = ["model", "dtype", "batch", "time(1) ms", *[f"t({n})/t(1)" for n in ns if n > 1]]
  header += [f"implied speedup r={r:g}" for r in RATES]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in rows:
    cells = [f"{r['model']} ({r['params'] / 1e6:.1f}M)", r["dtype"], str(r["batch"])]
    cells.append(f"{1e3 * r['time_s']['1']:.3f}")
    cells += [f"{r['ratio'][str(n)]:.2f}" for n in ns if n > 1]
    speedups = r.get("sbd_speedup", {})
    cells += [f"{speedups[str(x)]:.2f}x" if str(x) in speedups else "" for x in RATES]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
  """time(n) / time(1) against n, one panel per model, one line per (dtype, batch)."""
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional: the [plot] extra)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
  fig, axes = plt.subplots(1, len(models), figsize=(4.8 * len(models), 3.8), squeeze=False)
  for ax, model in zip(axes[0], models):
    for i, r in enumerate(x for x in rows if x["model"] == model):
      ns = sorted(int(n) for n in r["ratio"])
      style = "o-" if r["dtype"] == "float32" else "s--"
      label = f"{r['dtype']}, B={r['batch']}"
      ax.plot(ns, [r["ratio"][str(n)] for n in ns], style, color=f"C{i}", label=label)
    top = max(int(n) for r in rows for n in r["ratio"])
    ax.plot([1, top], [1, top], color="gray", lw=0.8, ls=":", label="time ∝ n")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_title(f"{model} ({rows[[r['model'] for r in rows].index(model)]['params'] / 1e6:.1f}M)")
    ax.set_xlabel("new tokens per row in one forward (n)")
    ax.set_ylabel("time(n) / time(1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _define_flags():
  flags.DEFINE_string("out", None, "Output directory (results.json, forward_curve.md/.png).")
  flags.DEFINE_list("models", ["tiny", "m100"], f"Random-weight models: {decode_speed.MODELS}.")
  flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Weights and compute dtypes.")
  flags.DEFINE_list("batches", ["1", "4"], "Rows per forward.")
  flags.DEFINE_list("ns", ["1", "2", "4", "8", "16", "32"], "New tokens per row.")
  flags.DEFINE_integer("cache_length", 256, "KV cache slots (filled up to the new tokens).")
  flags.DEFINE_integer("repeats", 3, "Timed repeats per point (medians).")
  decode_speed.define_schedule_flag()
  flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    batches, ns = [int(b) for b in f.batches], [int(n) for n in f.ns]
    decode_speed.check_models(f.models)
    if 1 not in ns or any(n < 1 for n in ns):
      raise ValueError(f"--ns must hold 1 and positive counts, got {ns}")
    if any(d not in ("float32", "bfloat16") for d in f.dtypes):
      raise ValueError(f"--dtypes must be float32 and/or bfloat16, got {f.dtypes}")
    xla_flags = decode_speed.use_xla_cpu_options(f.concurrent_schedule)
  except ValueError as e:
    cli.fail(e)
  os.makedirs(f.out, exist_ok=True)
  start, rows = time.perf_counter(), []
  for name in f.models:
    for dtype in f.dtypes:
      for batch in batches:
        rows.append(curve(name, dtype, batch, ns, f.cache_length, f.repeats))
        r = rows[-1]
        shown = ", ".join(f"t({n})/t(1) {r['ratio'][str(n)]:.2f}" for n in ns if n > 1)
        print(
          f"[{time.perf_counter() - start:6.0f}s] {name} {dtype} B={batch}: "
          f"time(1) {1e3 * r['time_s']['1']:.3f} ms; {shown}",
          file=sys.stderr,
          flush=True,
        )
  results = {
    "device": str(jax.devices()[0].device_kind),
    "xla_flags": xla_flags,
    "seconds": time.perf_counter() - start,
    "rows": rows,
  }
  table = format_markdown(rows)
  markdown.save(f.out, "forward_curve", results, table, lambda path: plot(rows, path))
  print(table)


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
