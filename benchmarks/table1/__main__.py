"""CLI: python -m benchmarks.table1 --out=DIR [--size=cpu|gpu|toy] [--ablation] (see
`run`)."""

from __future__ import annotations

import os

from absl import flags
from absl import logging as absl_logging

from benchmarks import xla_cpu
from benchmarks.table1 import run
from benchmarks.table1.sizes import SIZES
from sbd_jax import cli

flags.DEFINE_string("out", None, "Output directory (trained workdirs under it are reused).")
flags.DEFINE_enum("size", "cpu", sorted(SIZES), "Benchmark size.")
flags.DEFINE_bool("ablation", False, "Also train and evaluate a MATP-only model.")
flags.DEFINE_float("peak_tflops", 312.0, "Roofline: peak TFLOP/s of the given device.")
flags.DEFINE_float("bandwidth_gbs", 2039.0, "Roofline: memory bandwidth (GB/s) of the device.")
xla_cpu.define_schedule_flag()
flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint step at INFO
  f = flags.FLAGS
  xla_cpu.use_xla_cpu_options(f.concurrent_schedule)  # as decode_speed times
  run.run(
    f.out, f.size, ablation=f.ablation, peak_tflops=f.peak_tflops, bandwidth_gbs=f.bandwidth_gbs
  )
  with open(os.path.join(f.out, "table1.md")) as fh:
    print(fh.read())


if __name__ == "__main__":
  cli.run(main)
