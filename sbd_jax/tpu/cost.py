"""XLA's TPU cost model, read from a compiled program: its time estimate (`optimal_seconds`)
with the ops it has no model for taken back, its FLOPs and the bytes it accesses."""

from __future__ import annotations

import jax


def cost_analysis(compiled: jax.stages.Compiled) -> dict:
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older JAX: one dict per program
    cost = cost[0] if cost else {}
  return cost


# Ops the TPU compiler inserts itself but has no cost model for: each one adds exactly -1 s to
# `optimal_seconds`. On v4, v5e and v6e XLA splits large weights into pieces it prefetches and
# reassembles with a `ConcatBitcast` custom call (none on v5p); compiling the 8B forward with
# 1, 2 and 3 layers shows one -1 s per such call. The same program compiled without sliced
# prefetches (`xla_tpu_sliced_prefetch_max_slices=1`: no such calls) is estimated a few per
# cent slower, as a prefetch that overlaps more would make it (tests/test_aot.py).
#
# On v6e a train step whose embedding-gradient scatter the compiler offloads (to the SparseCores)
# starts and ends that offload with one `PrepareAsyncCallStart` / `PrepareAsyncCallDone` pair,
# which also count -1 s each: the SBD step of a toy model on a v6e-8 is estimated at -1.994 s
# with 18 ConcatBitcast calls, +0.006 s with the pair taken back too (the offloaded scatter
# itself then runs beside the TensorCores, uncosted).
UNCOSTED_CUSTOM_CALLS = ("ConcatBitcast", "PrepareAsyncCallStart", "PrepareAsyncCallDone")


def uncosted_ops(compiled: jax.stages.Compiled) -> int:
  """How many ops of the optimised program are in UNCOSTED_CUSTOM_CALLS."""
  hlo = compiled.as_text()
  return sum(hlo.count(f'custom_call_target="{name}"') for name in UNCOSTED_CUSTOM_CALLS)


def estimated_seconds(compiled: jax.stages.Compiled, what: str = "this program") -> float:
  """XLA's `optimal_seconds`, with the -1 s of each op it has no cost model for taken back (the
  op itself then counts as free: a reassembly of prefetched pieces, whose copies are costed)."""
  raw = float(cost_analysis(compiled).get("optimal_seconds", -1.0))
  seconds = raw + uncosted_ops(compiled)
  if seconds <= 0:
    raise RuntimeError(
      f"the TPU compiler gave no time estimate for {what} (optimal_seconds = {raw:.3g}, "
      f"{uncosted_ops(compiled)} ops without a cost model)"
    )
  return seconds
