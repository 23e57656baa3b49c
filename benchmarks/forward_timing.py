"""Timing cached forwards: time(n), one forward over n new tokens per row with a filled KV
cache, as the slope between loops of 1 and 1 + m forwards in one compiled program (no
per-call dispatch), at the cache fills a decode's forwards see.

Every timing is a median over repeats taken round-robin across the compared settings, so a
noisy, shared machine slows them alike; compilation is excluded and reported apart. The loops
also report their fastest timed call (`fastest_time_s`): the least disturbed estimate of what a
program costs (as `timeit` advises), with a bias of its own (a short program gets an
undisturbed call more often than a long one).

Dimension letters (docs/dimensions.md): B batch, T new tokens, S cache slots, V vocabulary.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import sampler
from sbd_jax.decode.compiled import StaticGraph
from sbd_jax.model.kv_cache import KVCache


@functools.partial(jax.jit, static_argnames=("graph",))
def _forwards(graph: StaticGraph, weights, cache: KVCache, tokens_BT, meta: TokenMeta, count):
  """`count` (traced) cached forwards of the same T tokens in one program: one compilation
  times any count, so a forward's cost is a difference of counts, without the per-call
  dispatch."""

  def body(i, carry):
    acc, cache_i = carry
    # Tokens and positions depend on the carry, so XLA can neither hoist nor merge the
    # forwards: with fixed positions it would compute the RoPE angles (and the attention
    # masks, which read positions) once per call, where a decode's forwards each compute
    # theirs, and time(n) would come out short.
    never = (acc > 1e30).astype(jnp.int32)
    meta_i = meta.replace(positions=meta.positions + never)
    logits_BTV, new_cache = nnx.merge(graph.graphdef, graph.state(weights))(
      tokens_BT + never, meta_i, cache_i
    )
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


class ForwardLoops:
  """Prepared time(n) loops (see `time_forwards`): each `round()` times every n once."""

  def __init__(
    self,
    model: sampler.SamplingModel,
    *,
    batch: int,
    cache_length: int,
    ns: Sequence[int],
    inner: int,
    min_loop_s: float = 0.02,
    cached_tokens: int | None = None,
  ):
    self.batch, self.ns = batch, tuple(ns)
    self.length = max(cache_length, max(ns) + 1)
    end = self.length - max(ns) if cached_tokens is None else cached_tokens
    if not 0 <= end <= self.length - max(ns):
      raise ValueError(
        f"cached_tokens={end} leaves no room for {max(ns)} new tokens in {self.length} slots"
      )
    self.end = end
    cache = filled_cache(model.cfg, batch, self.length, end)
    self.calls, self.compile_s = {}, {}
    for n in ns:
      pos_BT = jnp.broadcast_to(end + jnp.arange(n, dtype=jnp.int32), (batch, n))
      meta = TokenMeta.causal(jnp.ones_like(pos_BT), pos_BT)
      tokens_BT = jnp.zeros((batch, n), jnp.int32) + 32
      self.calls[n] = functools.partial(
        _forwards, model.static_graph, model.weights, cache, tokens_BT, meta
      )
      t0 = time.perf_counter()
      jax.block_until_ready(self.calls[n](np.int32(1)))
      self.compile_s[n] = time.perf_counter() - t0
    self.inners = {}
    for n in ns:  # a first estimate of the forward sets the loop's length
      t0 = time.perf_counter()
      jax.block_until_ready(self.calls[n](np.int32(1 + inner)))
      guess = (time.perf_counter() - t0) / (1 + inner)
      self.inners[n] = int(min(max(inner, np.ceil(min_loop_s / max(guess, 1e-7))), 4096))
    self.one: dict[int, list[float]] = {n: [] for n in ns}
    self.many: dict[int, list[float]] = {n: [] for n in ns}

  @property
  def rounds(self) -> int:
    return len(self.one[self.ns[0]])

  def round(self) -> None:
    for n in self.ns:
      for count, samples in ((1, self.one), (1 + self.inners[n], self.many)):
        t0 = time.perf_counter()
        jax.block_until_ready(self.calls[n](np.int32(count)))
        samples[n].append(time.perf_counter() - t0)

  def result(self) -> dict[str, Any]:
    ns = self.ns
    times = {n: self._time(n, np.median) for n in ns}
    return {
      "batch": self.batch,
      "cache_length": self.length,
      "cached_tokens": self.end,
      "inner": {str(n): self.inners[n] for n in ns},
      "repeats": self.rounds,
      "time_s": {str(n): times[n][0] for n in ns},
      # The same slope between each loop's fastest calls (`fastest`).
      "fastest_time_s": {str(n): self._time(n, np.min)[0] for n in ns},
      "one_forward_call_s": {str(n): self.one[n] for n in ns},
      "loop_call_s": {str(n): self.many[n] for n in ns},
      "by_slope": {str(n): times[n][1] for n in ns},
      "call_overhead_s": {
        str(n): max(float(np.median(self.one[n])) - times[n][0], 0.0) for n in ns
      },
      "first_call_s": {str(n): self.compile_s[n] for n in ns},
      "ratio_to_time1": {str(n): times[n][0] / times[min(ns)][0] for n in ns},
    }

  def _time(self, n: int, stat) -> tuple[float, bool]:
    """(time(n), whether it is a slope) from `stat` (median or min) of each loop's calls."""
    one, many = stat(self.one[n]), stat(self.many[n])
    slope = (many - one) / self.inners[n]
    # Timer noise can swamp a forward of microseconds: then the loop's mean is the estimate.
    if slope > 0:
      return float(slope), True
    return float(many / (1 + self.inners[n])), False


def fill_steps(cfg, cache_length: int, n: int, start: int, end: int) -> list[tuple[int, float]]:
  """Cache fills at which to time a forward of n new tokens so that, weighted, they stand for
  forwards whose keys reach every slot in (start, end] alike: [(cached tokens, weight)].

  Chunked attention over a cache (`attention.chunked.chunked_attention`) reads it in chunks of
  min(attention_chunk, cache_length) slots and skips the chunks no query sees, so a forward's
  cost steps up each time its keys reach into another chunk, rather than growing with the
  fill. Timed at the decode's mean fill alone, time(n) would miss the forwards past a step.
  One fill per step instead, the middle of the reach that step covers, weighted by that part
  of the range. The dense reference reads every slot: one step."""
  if not 0 <= start < end <= cache_length:
    raise ValueError(f"reach ({start}, {end}] is not inside a cache of {cache_length} slots")
  chunk = cache_length if cfg.attention_impl == "dense" else min(cfg.attention_chunk, cache_length)
  steps, low = [], start
  while low < end:
    high = min(end, (low // chunk + 1) * chunk)  # every reach in (low, high] reads as many chunks
    middle = (low + high + 1) // 2
    steps.append((min(max(middle - n, 0), cache_length - n), (high - low) / (end - start)))
    low = high
  return steps


def time_forwards(
  model: sampler.SamplingModel,
  *,
  batch: int,
  cache_length: int,
  ns: Sequence[int],
  repeats: int,
  inner: int,
  min_loop_s: float = 0.02,
  cached_tokens: int | None = None,
) -> dict[str, Any]:
  """time(n): seconds of one forward over n new tokens per sequence with a filled KV cache.

  The cache holds `cached_tokens` committed tokens (default `cache_length - max(ns)`, a cache
  as full as a decode's last forward sees it; 0 for a decode's first forward, which fills an
  empty cache); every n reads the same cache. Each repeat times one call of a jitted loop of 1
  forward and one of 1 + `inner` forwards; the difference of their medians over `inner` is a
  forward's cost inside a device loop (as the decode loop runs it), free of the per-call
  dispatch and synchronisation, which is reported apart (`call_overhead_s`: one call's time
  less its forward). `inner` is raised per n until the loop lasts about `min_loop_s` (the count
  is traced: no recompilation), so forwards of tens of microseconds are not lost in the
  timer's and the dispatch's jitter. Where noise still makes the difference non-positive, the
  loop's mean stands in (`by_slope` false). Repeats are taken round-robin over n; compile times
  are reported per n.
  """
  loops = ForwardLoops(
    model, batch=batch, cache_length=cache_length, ns=ns, inner=inner, min_loop_s=min_loop_s,
    cached_tokens=cached_tokens,
  )  # fmt: skip
  for _ in range(repeats):
    loops.round()
  return loops.result()


class SteppedForwardLoops:
  """time(n) over the cache fills a decode's forwards see (`fill_steps`): one `ForwardLoops` per
  (n, step), each `round()` timing all. `result()` has `ForwardLoops.result()`'s fields, each
  time the steps' weighted mean, and `steps` {n: [[cached tokens, weight, time]]}."""

  def __init__(
    self,
    model: sampler.SamplingModel,
    *,
    batch: int,
    cache_length: int,
    ns: Sequence[int],
    inner: int,
    reach: tuple[int, int],
  ):
    self.steps = {n: fill_steps(model.cfg, cache_length, n, *reach) for n in ns}
    self.loops = {
      (n, fill): ForwardLoops(
        model, batch=batch, cache_length=cache_length, ns=(n,), inner=inner, cached_tokens=fill
      )
      for n, steps in self.steps.items()
      for fill, _ in steps
    }

  @property
  def rounds(self) -> int:
    return min(lp.rounds for lp in self.loops.values())

  def round(self) -> None:
    for lp in self.loops.values():
      lp.round()

  def result(self) -> dict[str, Any]:
    parts = {key: lp.result() for key, lp in self.loops.items()}

    def per_n(field: str, combine) -> dict[str, Any]:
      return {
        str(n): combine([(w, parts[(n, fill)][field][str(n)]) for fill, w in steps])
        for n, steps in self.steps.items()
      }

    weighted = lambda pairs: float(sum(w * t for w, t in pairs))  # noqa: E731
    listed = lambda pairs: [x for _, xs in pairs for x in xs]  # noqa: E731
    out = {
      "batch": next(iter(parts.values()))["batch"],
      "cache_length": next(iter(parts.values()))["cache_length"],
      # The weighted mean fill over the steps of the longest forward, for display.
      "cached_tokens": round(sum(w * fill for fill, w in self.steps[max(self.steps)])),
      "steps": {
        str(n): [[fill, w, parts[(n, fill)]["time_s"][str(n)]] for fill, w in steps]
        for n, steps in self.steps.items()
      },
      "repeats": self.rounds,
      "time_s": per_n("time_s", weighted),
      "fastest_time_s": per_n("fastest_time_s", weighted),
      "call_overhead_s": per_n("call_overhead_s", weighted),
      "first_call_s": per_n("first_call_s", weighted),
      "inner": per_n("inner", lambda pairs: [x for _, x in pairs]),
      "one_forward_call_s": per_n("one_forward_call_s", listed),
      "loop_call_s": per_n("loop_call_s", listed),
      "by_slope": per_n("by_slope", lambda pairs: all(x for _, x in pairs)),
    }
    times = out["time_s"]
    out["ratio_to_time1"] = {n: t / times[min(times, key=int)] for n, t in times.items()}
    return out
