"""What the KV cache's layout and per-row writes cost one TPU decode forward, by XLA's estimate.

    python -m sbd_jax.benchmarks.tpu_cache_layout --config=configs/llama8b.py \
        --chips=v5p-8,v5e-8 [--batches=1,32 --n=16 --cache_length=2048 --out=DIR]

For each slice and batch, the sampler's cached forward (`tpu_time.compile_forward`, every
layer) is compiled four ways: the cache slots-first [B, S, K, H] or heads-first [B, K, S, H]
(the decode's TPU layout, `KVCache.heads_first`), written at one offset for the batch (rows in
lockstep, NTP) or at per-row offsets (SBD rows moving through their blocks alone). The table
gives `optimal_seconds` of each. One forward compiled alone has its cache layout fixed at the
program's entry, so the copies a decode loop adds when its write and its attention disagree
on the layout do not show here (`python -m sbd_jax.aot --mode=decode` counts those).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags
from ml_collections import config_flags

from sbd_jax import cli
from sbd_jax import config as config_lib
from sbd_jax.benchmarks import markdown, tpu_time

# (heads_first, per_row_offsets), in the table's column order.
VARIANTS = list(itertools.product((False, True), (False, True)))


def variant_name(heads_first: bool, per_row_offsets: bool) -> str:
  layout = "heads-first" if heads_first else "slots-first"
  return f"{layout}, {'per-row offsets' if per_row_offsets else 'one offset'}"


def run(
  c, chips: Sequence[str], *, batches: Sequence[int], n: int, cache_length: int
) -> dict[str, Any]:
  """Estimated seconds per (slice, batch, variant)."""
  num_layers = config_lib.to_model_config(c).num_layers
  rows = []
  for name in chips:
    _, devices = tpu_time.slice_devices(name)
    for batch in batches:
      seconds = {}
      for heads_first, per_row in VARIANTS:
        compiled, _ = tpu_time.compile_forward(
          c, devices, batch=batch, cache_length=cache_length, n=n, num_layers=num_layers,
          heads_first=heads_first, per_row_offsets=per_row,
        )  # fmt: skip
        variant = variant_name(heads_first, per_row)
        what = f"{name}, batch {batch}, {variant}"
        seconds[variant] = tpu_time.estimated_seconds(compiled, what)
        print(f"  {what}: {1e6 * seconds[variant]:.1f} us", file=sys.stderr, flush=True)
      rows.append({"chips": name, "batch": batch, "seconds": seconds})
  return {"n": n, "cache_length": cache_length, "num_layers": num_layers, "rows": rows}


def format_markdown(out: dict[str, Any]) -> str:
  names = [variant_name(*v) for v in VARIANTS]
  body = [
    [r["chips"], str(r["batch"])] + [f"{1e3 * r['seconds'][k]:.2f}" for k in names]
    for r in out["rows"]
  ]
  title = (
    f"One cached forward of {out['n']} new tokens per row over {out['cache_length']} slots "
    f"({out['num_layers']} layers), XLA's TPU estimate in ms"
  )
  return title + "\n\n" + markdown.table(["chips", "batch", *names], body)


def _define_flags():
  config_flags.DEFINE_config_file("config", None, "Model config (e.g. configs/llama8b.py).")
  flags.DEFINE_list("chips", ["v5p-8", "v5e-8"], "Slices (tensor parallel) or generations.")
  flags.DEFINE_list("batches", ["1", "32"], "Rows per forward.")
  flags.DEFINE_integer("n", 16, "New tokens per row.")
  flags.DEFINE_integer("cache_length", 2048, "KV cache slots.")
  flags.DEFINE_string("out", None, "Directory for results.json and table.md.")
  flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    out = run(
      f.config, f.chips, batches=[int(b) for b in f.batches], n=f.n, cache_length=f.cache_length
    )
  except (config_lib.ConfigError, ValueError, RuntimeError) as e:
    cli.fail(e)
  markdown.print_and_save(f.out, "table", out, format_markdown(out))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
