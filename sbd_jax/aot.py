"""Ahead-of-time compilation for a TPU slice this machine does not have: memory fit and FLOPs.

    python -m sbd_jax.aot --config=configs/llama8b.py --topology=v5p-16 [--mode=train|ntp]
        [--config.train.seq_len=8192 ...] [--noestimate] [--step_time_s=T] [--json]
        [--compiler_option=xla_tpu_...=VALUE ...]
    python -m sbd_jax.aot --config=configs/llama8b.py --topology=v5e-8 --mode=decode
        [--rows=8 --prompt_len=2048 --max_new_tokens=N --block_size=K --decode_mode=sbd]
        [--refill --queue=64 --refill_rows=1]         # decode settings default to the config's
        [--compile_cache=DIR]                         # JAX's persistent cache (see below)

With `libtpu` installed (`pip install -e ".[tpu]"`), JAX on a CPU-only machine can describe a
TPU slice and compile for it. This builds the abstract sharded train state with `eval_shape`
(nothing is allocated), lowers the real train step for the config's mesh over the slice's
devices, compiles it, and prints XLA's per-device memory (arguments, outputs, temporaries)
against the chip's HBM, and its FLOPs per step. It exits 1 with a one-line reason when the
step does not fit. `--mode=train` is the config's objective (the SBD step), `--mode=ntp` the plain
next-token step of the same model, rows and mesh. For both it also estimates the step's time
(`tpu.step_time`: XLA's TPU cost model over the layers, plus splash attention's kernels at the
chips' peak, which that model does not cost) and derives tokens/s/chip and MFU, counting the
rows' tokens and model FLOPs, and separately the tokens the step processes (2L per row for
SBD); `--noestimate` skips the two extra compilations it takes. `--mode=decode` does the same for the sampler's decode loop (its KV cache,
weights placed for sampling) on the decoding mesh: `sample.mesh_shape`, by default the weights
tensor-parallel over one host's chips and the rows over the rest; with `--refill`, for the loop
that decodes a queue of `--queue` prompts through the rows, finished rows refilled
`--refill_rows` at a time (`decode.queue`). `--compile_cache=DIR` points JAX's persistent cache
at DIR: JAX writes the program there, but for a described slice (no TPU attached) it cannot load
it back ("PjRtCompiler must be constructed with a Client"), so a second run compiles again; on
the slice itself the train step's cache (`config.compile_cache`) loads.

`--topology` takes a slice name (`v5p-16`: 16 TensorCores = 8 chips; `v5e-16` / `v6e-16`: 16
chips; `v4-16`: 16 TensorCores) or a chip grid as JAX names it (`v5p:2x2x4`, `v6e:4x4`).
`--num_slices=N` compiles for N such slices joined by the data-centre network (multislice),
on the hybrid mesh `mesh.dcn_shape` describes (default: the slices on the data axis).
"""

from __future__ import annotations

import json
import sys

from absl import flags
from ml_collections import config_flags

from sbd_jax import cli, compile_cache
from sbd_jax import config as config_lib
from sbd_jax.tpu.programs import DecodeShape
from sbd_jax.tpu.report import format_report, no_fit_reason, report


def _define_flags():
  """CLI flags, defined only when run as a script (so the module imports as a library)."""
  config_flags.DEFINE_config_file("config", None, "Experiment config file.")
  flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-16, v6e-8, v5p:2x2x4.")
  flags.DEFINE_integer(
    "num_slices", 1, "Slices of --topology joined by the data-centre network (multislice)."
  )
  flags.DEFINE_float("step_time_s", 0.0, "Report the MFU this step time implies.")
  flags.DEFINE_bool("json", False, "Print the report as JSON.")
  flags.DEFINE_enum(
    "mode", "train", ["train", "ntp", "decode"], "train: the config's step; ntp: plain NTP step."
  )
  flags.DEFINE_bool("estimate", True, "train / ntp: estimate the step's time (2 more compiles).")
  flags.DEFINE_multi_string(
    "compiler_option", [], "NAME=VALUE passed to XLA's compile (e.g. a TPU flag); repeatable."
  )
  flags.DEFINE_string("compile_cache", None, "JAX's persistent compilation cache directory.")
  shape = DecodeShape()
  flags.DEFINE_integer("rows", shape.rows, "decode: rows per batch.")
  flags.DEFINE_integer("prompt_len", shape.prompt_len, "decode: prompt slots.")
  flags.DEFINE_integer("queue", shape.queue, "decode with --refill: prompts queued.")
  # Decode settings; not given: the config's `sample` group.
  flags.DEFINE_integer("max_new_tokens", None, "decode: generated tokens.")
  flags.DEFINE_integer("block_size", None, "decode: SBD block size.")
  flags.DEFINE_enum("decode_mode", "sbd", ["sbd", "ntp"], "decode: SBD or NTP.")
  flags.DEFINE_bool("lockstep", None, "decode: SBD rows in lockstep (default: alone).")
  flags.DEFINE_bool("verify", None, "decode: verified SBD (--noverify with --lockstep).")
  flags.DEFINE_bool("refill", None, "decode: a queue of prompts, finished rows refilled.")
  flags.DEFINE_integer("refill_rows", None, "decode with --refill: rows refilled together.")
  flags.mark_flags_as_required(["config", "topology"])


def compiler_options(pairs: list[str]) -> dict:
  """["name=value", ...] -> {name: value}, values read as bool, int or float where they are."""
  options = {}
  for pair in pairs:
    name, sep, value = pair.partition("=")
    if not sep or not name:
      raise config_lib.ConfigError(f"--compiler_option={pair!r}: expected NAME=VALUE")
    lowered = value.lower()
    if lowered in ("true", "false"):
      options[name] = lowered == "true"
      continue
    for kind in (int, float):
      try:
        options[name] = kind(value)
        break
      except ValueError:
        pass
    else:
      options[name] = value
  return options


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    refill = f.config.sample.refill if f.refill is None else f.refill
    for name in ("queue", "refill_rows"):
      if f[name].present and not (refill and f.mode == "decode"):
        raise config_lib.ConfigError(f"--{name} applies to --mode=decode --refill")
    decode, sampling = None, {}
    if f.mode == "decode":
      decode = DecodeShape(f.rows, f.prompt_len, f.queue)
      sampling = dict(
        mode=f.decode_mode, block_size=f.block_size, max_new_tokens=f.max_new_tokens,
        lockstep=f.lockstep, verify=f.verify, refill=f.refill, refill_rows=f.refill_rows,
      )  # fmt: skip
    if f.step_time_s and f.mode == "decode":
      raise config_lib.ConfigError("--step_time_s applies to a train step (--mode=train or ntp)")
    compile_cache.enable(compile_cache.directory(f.compile_cache or "", None))
    r = report(
      f.config, f.topology, f.step_time_s, decode, f.num_slices,
      objective="ntp" if f.mode == "ntp" else None,
      estimate=f.estimate and f.mode != "decode",
      compiler_options=compiler_options(f.compiler_option),
      **sampling,
    )  # fmt: skip
  except (config_lib.ConfigError, ValueError) as e:
    cli.fail(e)
  print(json.dumps(r, indent=2) if f.json else format_report(r))
  if not r["fits"]:
    print(f"error: {no_fit_reason(r)}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
