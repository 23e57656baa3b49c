"""time(n) of a model's cached decode forward on TPU chips, from XLA's TPU cost model, compiled
ahead of time on a machine without a TPU; and the SBD wall-clock speedup it implies.

    python -m benchmarks.tpu_time --config=configs/llama8b.py --chips=v5p,v5e-8 \
        [--batches=1,8,32 --ns=1,2,4,8,16,32 --cache_length=4096 --block_size=16 \
        --check_layers --out=DIR]

For every (chips, batch, n) this lowers the sampler's real forward (`decode.loop.model_forward`: n
new tokens per row over a KV cache of `cache_length` slots, logits of those n positions,
bfloat16 weights and the cache as decoding holds them: the cache heads-first and donated, i.e.
updated in place) for one chip of a generation (`--chips=v5e`) or for a
whole slice with the weights split by tensor parallelism (`--chips=v5e-8`), and reads
`cost_analysis()["optimal_seconds"]`, the TPU compiler's own estimate of the program's time.
Nothing is allocated or run. On v4, v5e and v6e the compiler inserts ops it has no cost model
for, each counted as -1 s; their count is taken back (`UNCOSTED_CUSTOM_CALLS`). A point whose
estimate is still not positive raises an error naming it rather than entering the table.

Compiling 32-36 unrolled layers per point is slow on a CPU, so the model is compiled with one and
with two layers and time(n) = t_1 + (L - 1)(t_2 - t_1): the layers of a straight-line program add
up in XLA's estimate. `--check_layers` compiles one point per chip with every layer to show how
close that is (`full_layers_check` in results.json). On v5p the two agree to 0.1 %; on v5e they
do not (the compiler's sliced prefetches change with the program's size: the 8B forward on a
v5e-8 extrapolates to 1.38x its full compile), so there use `--all_layers`, which compiles every
point whole.

From time(n), the steady-state SBD speedup of a block of k tokens revealed in l forwards is
k time(1) / (time(2k) + (l - 1) time(k)) (the paper's section 4), given at several tokens per forward
r = k / l, next to the hand roofline (`roofline_model`) with the chip's peak FLOP/s and HBM
bandwidth. Writes results.json and table.md to --out.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import flags
from ml_collections import config_flags

from benchmarks import report, roofline_model
from sbd_jax import cli, sharding
from sbd_jax import config as config_lib
from sbd_jax.tpu.cost import estimated_seconds
from sbd_jax.tpu.topology import CHIPS, parse_topology, topology_devices

# HBM bandwidth per chip (public spec sheets), for the hand roofline beside XLA's estimate.
HBM_BYTES_PER_S = {"v4": 1228e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1640e9}
TOKENS_PER_FORWARD = (2.0, 3.0, 4.0, 6.0, 8.0)


def compile_forward(
  c,
  devices,
  *,
  batch: int,
  cache_length: int,
  n: int,
  num_layers: int,
  compiler_options: dict[str, Any] | None = None,
) -> tuple[jax.stages.Compiled, float]:
  """(compiled cached forward of n tokens per row, seconds to compile) for `devices`, over a
  KV cache in the decode's TPU layout (heads-first), written at one offset for the batch."""
  from flax import nnx

  from sbd_jax.attention.meta import TokenMeta
  from sbd_jax.decode import loop as decode_loop
  from sbd_jax.model.kv_cache import KVCache
  from sbd_jax.model.transformer import Transformer

  cfg = config_lib.to_model_config(c).for_decoding().replace(num_layers=num_layers)
  mesh = sharding.make_mesh((1, 1, len(devices)), devices)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  abstract = sharding.with_shardings(
    abstract, sharding.state_shardings(abstract, mesh, sharding.SAMPLING_RULES)
  )
  cache = jax.eval_shape(lambda: KVCache.empty(cfg, batch, cache_length, heads_first=True))

  def kv_sharding(x):
    spec = sharding.logical_to_spec(cache.logical_axes, sharding.ACTIVATION_RULES, mesh, x.shape)
    return jax.NamedSharding(mesh, spec)

  def place(x, s):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

  rows = sharding.batch_sharding(mesh)
  cache = cache.replace(
    k=tuple(place(x, kv_sharding(x)) for x in cache.k),
    v=tuple(place(x, kv_sharding(x)) for x in cache.v),
    meta=jax.tree.map(lambda x: place(x, rows), cache.meta),
    end=place(cache.end, sharding.replicated(mesh)),
  )
  tokens_BT = jax.ShapeDtypeStruct((batch, n), jnp.int32, sharding=rows)
  ones = jax.ShapeDtypeStruct((batch, n), jnp.int32, sharding=rows)
  meta = jax.eval_shape(TokenMeta.causal, ones, ones)
  meta = jax.tree.map(lambda x: place(x, rows), meta)
  # The cache is donated, as the decode loop's carry is: updated in place. Without it the
  # program would copy the whole cache to make its output, a cost the decode does not pay.
  forward = jax.jit(
    functools.partial(decode_loop.model_forward, mesh=mesh, last=n),
    static_argnums=(0,),
    donate_argnums=(4,),
  )
  start = time.perf_counter()
  with sharding.activation_sharding(mesh):
    lowered = forward.lower(graphdef, abstract, tokens_BT, meta, cache)
    compiled = lowered.compile(compiler_options=compiler_options)
  return compiled, time.perf_counter() - start


# The smallest slice JAX describes per generation; one of its chips is compiled for.
SMALLEST_SLICE = {"v4": "v4:2x2x1", "v5p": "v5p:2x2x1", "v5e": "v5e:2x2", "v6e": "v6e:2x2"}


def slice_devices(name: str) -> tuple[str, list]:
  """(generation, devices) for `name`: a generation ("v5e": one chip of it) or a slice
  ("v5e-8", "v5p:2x2x1": all its chips, tensor parallel)."""
  if name in SMALLEST_SLICE:
    return name, topology_devices(SMALLEST_SLICE[name])[:1]
  try:
    generation, topology = parse_topology(name)
  except config_lib.ConfigError as e:
    raise ValueError(f"--chips: {e}; or a generation: {sorted(SMALLEST_SLICE)}") from None
  return generation, topology_devices(topology)


def forward_times(
  c,
  name: str,
  *,
  batches: Sequence[int],
  ns: Sequence[int],
  cache_length: int,
  all_layers: bool = False,
) -> dict[str, Any]:
  """XLA's time(n) per batch on `name` (see `slice_devices`), extrapolated from one and two
  layers, or with `all_layers` compiled with every layer."""
  generation, devices = slice_devices(name)
  num_layers = config_lib.to_model_config(c).num_layers
  times, compile_s = {}, 0.0
  for batch in batches:
    times[str(batch)] = {}
    for n in ns:
      t = []
      for layers in (num_layers,) if all_layers else (1, 2):
        compiled, seconds = compile_forward(
          c, devices, batch=batch, cache_length=cache_length, n=n, num_layers=layers
        )
        what = f"{name}, batch {batch}, n {n}, {layers} layer(s)"
        t.append(estimated_seconds(compiled, what))
        compile_s += seconds
      times[str(batch)][str(n)] = t[0] if all_layers else t[0] + (num_layers - 1) * (t[1] - t[0])
      us = 1e6 * times[str(batch)][str(n)]
      print(f"  {name} batch {batch:>3} n {n:>3}: {us:9.1f} us", file=sys.stderr, flush=True)
  return {
    "name": name,
    "generation": generation,
    "chips": len(devices),
    "device_kind": devices[0].device_kind,
    "num_layers": num_layers,
    "layers_compiled": "all" if all_layers else "one and two, extrapolated",
    "time_s": times,
    "compile_s": round(compile_s, 1),
  }


def check_layers(
  c, name: str, *, batch: int, n: int, cache_length: int, extrapolated: float
) -> dict[str, Any]:
  """One point compiled with every layer, against the one-and-two-layer extrapolation."""
  layers = config_lib.to_model_config(c).num_layers
  compiled, seconds = compile_forward(
    c, slice_devices(name)[1], batch=batch, cache_length=cache_length, n=n, num_layers=layers
  )
  full = estimated_seconds(compiled)
  return {
    "batch": batch,
    "n": n,
    "full_s": full,
    "extrapolated_s": extrapolated,
    "ratio": extrapolated / full,
    "compile_s": round(seconds, 1),
  }


def sbd_speedup(times: dict[str, float], block_size: int, tokens_per_forward: float) -> float:
  """k time(1) / (time(2k) + (l - 1) time(k)) with l = k / r forwards per block."""
  k, l = block_size, block_size / tokens_per_forward
  return k * times["1"] / (times[str(2 * k)] + (l - 1) * times[str(k)])


def roofline_row(
  c,
  generation: str,
  batch: int,
  block_size: int,
  kv_len: int,
  rates: Sequence[float],
  chips: int = 1,
):
  """The hand roofline's time(n) and speedups for the same model on `chips` chips (weights and
  KV cache in bfloat16, split evenly; communication not counted)."""
  cfg = config_lib.to_model_config(c)
  model = roofline_model.Model.from_config(
    cfg, "model", bytes_per_weight=2.0, bytes_per_kv=2.0, bytes_per_activation=2.0
  )
  device = roofline_model.Device.from_peaks(
    generation,
    chips * CHIPS[generation].peak_flops,
    chips * HBM_BYTES_PER_S[generation],
  )
  times = {
    str(n): roofline_model.forward_time(model, device, batch, n, kv_len, include_lm_head=True)
    for n in (1, block_size, 2 * block_size)
  }
  return times, {str(r): sbd_speedup(times, block_size, r) for r in rates}


def run(
  c,
  names: Sequence[str],
  *,
  batches: Sequence[int],
  ns: Sequence[int],
  cache_length: int,
  block_size: int,
  check: bool,
  all_layers: bool = False,
) -> dict[str, Any]:
  needed = {1, block_size, 2 * block_size}
  if not needed <= set(ns):
    raise ValueError(f"--ns must include 1, the block size and twice it: {sorted(needed)}")
  rates = [r for r in TOKENS_PER_FORWARD if r <= block_size]  # at most k tokens per forward
  results = []
  for name in names:
    r = forward_times(
      c, name, batches=batches, ns=ns, cache_length=cache_length, all_layers=all_layers
    )
    r["sbd_speedup"], r["roofline"] = {}, {}
    for batch in batches:
      times = r["time_s"][str(batch)]
      r["sbd_speedup"][str(batch)] = {str(t): sbd_speedup(times, block_size, t) for t in rates}
      hand_times, hand_speedup = roofline_row(
        c, r["generation"], batch, block_size, cache_length, rates, chips=r["chips"]
      )
      r["roofline"][str(batch)] = {"time_s": hand_times, "sbd_speedup": hand_speedup}
    if check and not all_layers:
      batch, n = batches[0], block_size
      r["full_layers_check"] = check_layers(
        c,
        name,
        batch=batch,
        n=n,
        cache_length=cache_length,
        extrapolated=r["time_s"][str(batch)][str(n)],
      )
    results.append(r)
  return {
    "model": dataclasses.asdict(config_lib.to_model_config(c)),
    "cache_length": cache_length,
    "block_size": block_size,
    "tokens_per_forward": rates,
    "chips": results,
  }


def format_markdown(out: dict[str, Any]) -> str:
  k = out["block_size"]
  lines = [
    f"time(n) of one cached forward (XLA's TPU estimate, KV cache {out['cache_length']} slots), "
    f"as a multiple of time(1); SBD speedup k time(1) / (time(2k) + (l-1) time(k)) at k = {k} "
    "and r = k / l tokens per forward (hand roofline in brackets)",
    "",
  ]
  ns = sorted({int(n) for r in out["chips"] for t in r["time_s"].values() for n in t})
  rs = out["tokens_per_forward"]
  header = ["chips", "batch", "time(1) us", *[f"t({n})/t(1)" for n in ns if n > 1]]
  header += [f"speedup r={r:g}" for r in rs]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in out["chips"]:
    for batch, times in r["time_s"].items():
      hand = r["roofline"][batch]
      where = f"{r['name']} ({r.get('chips', 1)} x {r['device_kind']})"
      cells = [where, batch, f"{1e6 * times['1']:.1f}"]
      cells += [f"{times[str(n)] / times['1']:.3f}" for n in ns if n > 1]
      cells += [
        f"{r['sbd_speedup'][batch][str(x)]:.2f}x ({hand['sbd_speedup'][str(x)]:.2f}x)" for x in rs
      ]
      lines.append("| " + " | ".join(cells) + " |")
  checks = [
    (r.get("name", r["generation"]), r["full_layers_check"])
    for r in out["chips"]
    if "full_layers_check" in r
  ]
  if checks:
    lines.append("")
    for name, ch in checks:
      lines.append(
        f"- {name}, batch {ch['batch']}, n = {ch['n']}: all layers compiled "
        f"{1e6 * ch['full_s']:.1f} us, extrapolated from one and two {1e6 * ch['extrapolated_s']:.1f} us "
        f"(ratio {ch['ratio']:.3f})"
      )
  return "\n".join(lines)


def _define_flags():
  config_flags.DEFINE_config_file("config", None, "Model config (e.g. configs/llama8b.py).")
  flags.DEFINE_list(
    "chips",
    ["v5p"],
    "TPU generations (one chip of each: v4, v5e, v5p, v6e) or slices (v5e-8, v5p-8, "
    "v5p:2x2x1: all their chips, tensor parallel).",
  )
  flags.DEFINE_list("batches", ["1", "8", "32"], "Rows per forward.")
  flags.DEFINE_list("ns", ["1", "2", "4", "8", "16", "32"], "New tokens per row.")
  flags.DEFINE_integer("cache_length", 4096, "KV cache slots.")
  flags.DEFINE_integer("block_size", 16, "SBD block size k (ns must hold 1, k and 2k).")
  flags.DEFINE_bool("check_layers", False, "Also compile one point per slice with every layer.")
  flags.DEFINE_bool(
    "all_layers", False, "Compile every point with every layer instead of extrapolating."
  )
  flags.DEFINE_string("out", None, "Directory for results.json and table.md.")
  flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    out = run(
      f.config,
      f.chips,
      batches=[int(b) for b in f.batches],
      ns=[int(n) for n in f.ns],
      cache_length=f.cache_length,
      block_size=f.block_size,
      check=f.check_layers,
      all_layers=f.all_layers,
    )
  except (config_lib.ConfigError, ValueError, RuntimeError) as e:
    cli.fail(e)
  table = format_markdown(out)
  print(table)
  if f.out:
    report.save(f.out, "table", out, table)


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
