"""Measured wall-clock: cached forward time(n), decode time per token, and the paper's prediction.

All timings are medians over repeats taken round-robin across the compared settings (so a noisy,
shared machine slows them alike); compilation is excluded and reported separately.
Dimension letters follow `sbd_jax.model`: B batch, T new tokens, S cache slots, V vocabulary.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbd_jax import sampler
from sbd_jax.attention import TokenMeta
from sbd_jax.decode_loop import StaticGraph
from sbd_jax.model import KVCache


def paper_speedup(times: dict[int, float], block_size: int, forwards_per_block: float) -> float:
  """speedup(l, k) = k time(1) / (time(2k) + (l - 1) time(k)), with measured time(n)."""
  k, l = block_size, forwards_per_block
  return k * times[1] / (times[2 * k] + (l - 1) * times[k])


def accounted_speedup(
  times: dict[int, float],
  block_size: int,
  ntp_nfe: np.ndarray,
  sbd_nfe: np.ndarray,
  sbd_lengths: np.ndarray,
  prefill: tuple[float, float] | None = None,
  call: tuple[float, float] = (0.0, 0.0),
  sbd_wide: np.ndarray | None = None,
) -> float:
  """Predicted wall-clock speedup from the decodes' own counts: per sample, NTP costs nfe time(1);
  SBD costs one time(2k) per block (its first pass) plus time(k) per other forward. Summed over
  samples. `sbd_wide`, if given, is each sample's count of 2k-token forwards after the first
  forward (the decode's `batch_wide_forwards`; a batch whose rows move alone runs one whenever
  some row starts a block), in place of one per block after the first. Without `prefill` the
  prompt's forward is left out of both. With `prefill` = (NTP's prompt forward, SBD's
  prompt-plus-first-block forward), in seconds per batch, each decode's first forward is
  charged at that time instead (as the decode loop runs it). `call` = (NTP's, SBD's) cost of a
  decode call beyond its forwards, charged once per decode."""
  k = block_size
  ntp_nfe, sbd_nfe = np.asarray(ntp_nfe), np.asarray(sbd_nfe)
  blocks = np.maximum(np.ceil(np.asarray(sbd_lengths) / k), 1)
  wide = blocks - 1 if sbd_wide is None else np.asarray(sbd_wide)
  later = sbd_nfe - 1 - wide  # k-token forwards
  if prefill is None:
    ntp = np.sum(ntp_nfe) * times[1]
    sbd = np.sum((wide + 1) * times[2 * k] + later * times[k])
  else:  # like every other forward, the batch's prefill is charged to each sample
    ntp = np.sum(prefill[0] + (ntp_nfe - 1) * times[1])
    sbd = np.sum(prefill[1] + wide * times[2 * k] + later * times[k])
  ntp, sbd = ntp + len(ntp_nfe) * call[0], sbd + len(sbd_nfe) * call[1]
  return float(ntp / sbd)


def forwards_per_block(nfe: np.ndarray, lengths: np.ndarray, block_size: int) -> float:
  """Mean over samples of forwards per block touched (l of the paper)."""
  blocks = np.maximum(np.ceil(np.asarray(lengths) / block_size), 1)
  return float(np.mean(np.asarray(nfe) / blocks))


@functools.partial(jax.jit, static_argnames=("graph",))
def _forwards(graph: StaticGraph, weights, cache: KVCache, tokens_BT, meta: TokenMeta, count):
  """`count` (traced) cached forwards of the same T tokens in one program: one compilation
  times any count, so a forward's cost is a difference of counts, without the per-call
  dispatch."""

  def body(i, carry):
    acc, cache_i = carry
    # Tokens depend on the carry, so XLA can neither hoist nor merge the forwards.
    tokens = tokens_BT + (acc > 1e30).astype(jnp.int32)
    logits_BTV, new_cache = nnx.merge(graph.graphdef, graph.state(weights))(tokens, meta, cache_i)
    return acc + logits_BTV[:, -1, 0].sum(), new_cache.replace(end=cache_i.end)

  acc, _ = jax.lax.fori_loop(0, count, body, (jnp.zeros((), jnp.float32), cache))
  return acc


def filled_cache(cfg, batch: int, length: int, end: int, seed: int = 0) -> KVCache:
  """A cache of `length` slots whose first `end` hold random keys/values of one document."""
  cache = KVCache.empty(cfg, batch, length)
  keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_layers)
  shape = cache.k[0].shape
  k = tuple(jax.random.normal(keys[i], shape, cache.k[0].dtype) for i in range(cfg.num_layers))
  v = tuple(
    jax.random.normal(keys[cfg.num_layers + i], shape, cache.v[0].dtype)
    for i in range(cfg.num_layers)
  )
  slot_S = jnp.arange(length, dtype=jnp.int32)
  seg_BS = jnp.broadcast_to((slot_S < end).astype(jnp.int32), (batch, length))
  meta = cache.meta.replace(segment_ids=seg_BS, positions=jnp.broadcast_to(slot_S, (batch, length)))
  return cache.replace(k=k, v=v, meta=meta, end=jnp.asarray(end, jnp.int32))


def time_forwards(
  model: sampler.SamplingModel,
  *,
  batch: int,
  cache_length: int,
  ns: Sequence[int],
  repeats: int,
  inner: int,
  min_loop_s: float = 0.02,
) -> dict[str, Any]:
  """time(n): seconds of one forward over n new tokens per sequence with a filled KV cache.

  The cache holds `cache_length - max(ns)` committed tokens; every n reads the same cache. Each
  repeat times one call of a jitted loop of 1 forward and one of 1 + `inner` forwards; the
  difference of their medians over `inner` is a forward's cost inside a device loop (as the
  decode loop runs it), free of the per-call dispatch and synchronisation, which is reported
  apart (`call_overhead_s`: one call's time less its forward). `inner` is raised per n until
  the loop lasts about `min_loop_s` (the count is traced: no recompilation), so forwards of
  tens of microseconds are not lost in the timer's and the dispatch's jitter. Where noise still
  makes the difference non-positive, the loop's mean stands in (`by_slope` false). Repeats are
  taken round-robin over n; compile times are reported per n.
  """
  cfg = model.cfg
  length = max(cache_length, max(ns) + 1)
  end = length - max(ns)
  cache = filled_cache(cfg, batch, length, end)
  calls, compile_s = {}, {}
  for n in ns:
    pos_BT = jnp.broadcast_to(end + jnp.arange(n, dtype=jnp.int32), (batch, n))
    meta = TokenMeta.causal(jnp.ones_like(pos_BT), pos_BT)
    tokens_BT = jnp.zeros((batch, n), jnp.int32) + 32
    calls[n] = functools.partial(
      _forwards, model.static_graph, model.weights, cache, tokens_BT, meta
    )
    t0 = time.perf_counter()
    jax.block_until_ready(calls[n](np.int32(1)))
    compile_s[n] = time.perf_counter() - t0
  inners = {}
  for n in ns:  # a first estimate of the forward sets the loop's length
    t0 = time.perf_counter()
    jax.block_until_ready(calls[n](np.int32(1 + inner)))
    guess = (time.perf_counter() - t0) / (1 + inner)
    inners[n] = int(min(max(inner, np.ceil(min_loop_s / max(guess, 1e-7))), 4096))
  one: dict[int, list[float]] = {n: [] for n in ns}
  many: dict[int, list[float]] = {n: [] for n in ns}
  for _ in range(repeats):
    for n in ns:
      for count, samples in ((1, one), (1 + inners[n], many)):
        t0 = time.perf_counter()
        jax.block_until_ready(calls[n](np.int32(count)))
        samples[n].append(time.perf_counter() - t0)
  times, overhead, by_slope = {}, {}, {}
  for n in ns:
    slope = (np.median(many[n]) - np.median(one[n])) / inners[n]
    # Timer noise can swamp a forward of microseconds: then the loop's mean is the estimate.
    by_slope[n] = bool(slope > 0)
    times[n] = float(slope if by_slope[n] else np.median(many[n]) / (1 + inners[n]))
    overhead[n] = float(max(np.median(one[n]) - times[n], 0.0))
  return {
    "batch": batch,
    "cache_length": length,
    "cached_tokens": end,
    "inner": {str(n): inners[n] for n in ns},
    "repeats": repeats,
    "time_s": {str(n): times[n] for n in ns},
    "one_forward_call_s": {str(n): one[n] for n in ns},
    "loop_call_s": {str(n): many[n] for n in ns},
    "by_slope": {str(n): by_slope[n] for n in ns},
    "call_overhead_s": {str(n): overhead[n] for n in ns},
    "first_call_s": {str(n): compile_s[n] for n in ns},
    "ratio_to_time1": {str(n): times[n] / times[min(ns)] for n in ns},
  }


def time_decodes(
  model: sampler.SamplingModel,
  prompts: Sequence[Sequence[int]],
  settings: Sequence[sampler.SamplerSettings],
  *,
  batch_size: int,
  repeats: int,
  log=print,
  warm: bool = False,
  min_total_s: float = 0.0,
  max_repeats: int = 201,
) -> list[dict[str, Any]]:
  """Decode the same prompts with each setting `repeats` times (round-robin); first call apart.

  With `warm`, each timed call directly follows an untimed call of the same setting, as when
  one program decodes request after request; otherwise a call follows another setting's
  program, and on a CPU pays for caches that program evicted (about 0.7 ms per call for the
  tiny model, as much as its whole SBD decode). Rounds go on past `repeats`, up to
  `max_repeats`, until every setting has `min_total_s` of timed calls: a decode of a few
  milliseconds needs dozens of samples for a stable median on a shared machine.

  Returns per setting: first_call_s (compile + one decode), median_s, samples_s, the per-sample
  NFE and kept lengths, and seconds per generated token (median_s / kept tokens).
  """
  outs, first = [], []
  for s in settings:
    t0 = time.perf_counter()
    outs.append(sampler.decode(model, prompts, s, batch_size=batch_size))
    first.append(time.perf_counter() - t0)
    log(f"[wallclock] compiled + first decode {describe(s)}: {first[-1]:.2f}s")
  samples: list[list[float]] = [[] for _ in settings]

  def more() -> bool:  # `repeats` rounds, more while a setting has under `min_total_s` timed
    rounds = len(samples[0])
    short = min(sum(t) for t in samples) < min_total_s
    return rounds < repeats or (short and rounds < max_repeats)

  while more():
    for i, s in enumerate(settings):
      if warm:
        sampler.decode(model, prompts, s, batch_size=batch_size)
      t0 = time.perf_counter()
      sampler.decode(model, prompts, s, batch_size=batch_size)
      samples[i].append(time.perf_counter() - t0)
  results = []
  for s, out, t_first, t in zip(settings, outs, first, samples):
    lengths = np.asarray([len(x) for x in out.tokens])
    median = float(np.median(t))
    results.append(
      {
        "settings": describe(s),
        "mode": s.mode,
        "rule": s.rule,
        "gamma": s.gamma,
        "first_call_s": t_first,
        "median_s": median,
        "samples_s": t,
        "nfe": out.nfe.tolist(),
        "batch_forwards": out.batch_forwards.tolist(),
        "batch_wide_forwards": out.batch_wide_forwards.tolist(),
        "lengths": lengths.tolist(),
        "tokens": int(lengths.sum()),
        "forwards": int(out.nfe.sum()),
        "s_per_token": median / max(int(lengths.sum()), 1),
        "s_per_forward": median / max(int(out.nfe.sum()), 1) if batch_size == 1 else math.nan,
      }
    )
  return results


def describe(s: sampler.SamplerSettings) -> str:
  if s.mode == "ntp":
    return "NTP"
  return f"SBD {s.rule} γ={s.gamma:g} k={s.block_size}" + (" lockstep" if s.lockstep else "")
