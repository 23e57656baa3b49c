"""Measured wall-clock: cached forward time(n), decode time per token, and the paper's prediction.

All timings are medians over repeats taken round-robin across the compared settings (so a noisy,
shared machine slows them alike); compilation is excluded and reported separately.

Fastest calls: decodes (`min_s`) and time(n) loops (`fastest_time_s`) also report their fastest
timed call. Interference on a shared machine only ever adds time, and not to every program
alike: on this 2-core VM, 25 calls of the same tiny-model decode spread over 1.25-1.6x their
fastest (the median 1.05-1.23x, per setting and process), a time(n) loop's over 1.24-1.59x
(1.03-1.16x).
The fastest call is the least disturbed estimate of what a program costs (as `timeit` advises).
It has a bias of its own: a short program gets an undisturbed call more often than a long one.

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

from sbd_jax.attention.meta import TokenMeta
from sbd_jax.decode import sampler
from sbd_jax.decode.compiled import StaticGraph
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.model.kv_cache import KVCache


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
    # Tokens and positions depend on the carry, so XLA can neither hoist nor merge the
    # forwards. With fixed positions it computed the RoPE angles (and the attention masks,
    # which read positions) once per call, where a decode's forwards each compute theirs:
    # the tiny model's time(1) came out 17 % short, time(16) 5 %, time(32) 11 %.
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

  Chunked attention over a cache (`attention.chunked_attention`) reads it in chunks of
  min(attention_chunk, cache_length) slots and skips the chunks no query sees, so a forward's
  cost steps up each time its keys reach into another chunk, rather than growing with the
  fill: the tiny model's time(16) over its 272-slot cache (chunks of 176) was 605-628 µs with
  at most 144 cached tokens and 696-706 µs with 170 or more (BENCHMARKS.md, session 27). Timed
  at the decode's mean fill alone, time(n) then misses the forwards past a step. One fill per
  step instead, the middle of the reach that step covers, weighted by that part of the range.
  The dense reference reads every slot: one step."""
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


class DecodeRounds:
  """Prepared decodes of the same prompts with each setting (see `time_decodes`): each
  `round()` times every setting once. Every batch's prompts are padded to at least
  `min_bucket` slots, and with `cache_length` every decode gets a cache of that many slots
  (`sampler.decode`)."""

  def __init__(
    self,
    model: sampler.SamplingModel,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[SamplerSettings],
    *,
    batch_size: int,
    warm: bool = False,
    min_bucket: int = 16,
    cache_length: int | None = None,
    log=print,
  ):
    self.model, self.prompts, self.settings = model, prompts, list(settings)
    self.batch_size, self.warm, self.min_bucket = batch_size, warm, min_bucket
    self.cache_length = cache_length
    self.outs, self.first = [], []
    for s in self.settings:
      t0 = time.perf_counter()
      self.outs.append(self._decode(s))
      self.first.append(time.perf_counter() - t0)
      log(f"[wallclock] compiled + first decode {describe(s)}: {self.first[-1]:.2f}s")
    self.samples: list[list[float]] = [[] for _ in self.settings]

  def _decode(self, s: SamplerSettings) -> sampler.DecodeOutput:
    return sampler.decode(
      self.model,
      self.prompts,
      s,
      batch_size=self.batch_size,
      min_bucket=self.min_bucket,
      cache_length=self.cache_length,
    )

  @property
  def rounds(self) -> int:
    return len(self.samples[0])

  @property
  def least_timed_s(self) -> float:
    """Timed seconds of the setting with the fewest."""
    return min(sum(t) for t in self.samples)

  def expected_rounds(self, repeats: int, min_total_s: float, max_repeats: int) -> int:
    """Rounds until every setting has `min_total_s` timed, from the calls timed so far."""
    slowest_needed = max(min_total_s / max(np.mean(t), 1e-9) for t in self.samples)
    return int(min(max(repeats, np.ceil(slowest_needed)), max_repeats))

  def round(self) -> None:
    for s, samples in zip(self.settings, self.samples):
      if self.warm:
        self._decode(s)
      t0 = time.perf_counter()
      self._decode(s)
      samples.append(time.perf_counter() - t0)

  def result(self) -> list[dict[str, Any]]:
    results = []
    for s, out, t_first, t in zip(self.settings, self.outs, self.first, self.samples):
      lengths = np.asarray([len(x) for x in out.tokens])
      median = float(np.median(t))
      one_row = self.batch_size == 1
      results.append(
        {
          "settings": describe(s),
          "mode": s.mode,
          "rule": s.rule,
          "gamma": s.gamma,
          "first_call_s": t_first,
          "median_s": median,
          "min_s": float(np.min(t)),  # the fastest timed call (`fastest`)
          "samples_s": t,
          "nfe": out.nfe.tolist(),
          "batch_forwards": out.batch_forwards.tolist(),
          "batch_wide_forwards": out.batch_wide_forwards.tolist(),
          "lengths": lengths.tolist(),
          "tokens": int(lengths.sum()),
          "forwards": int(out.nfe.sum()),
          "loop_forwards": out.forwards,
          "loop_wide_forwards": out.wide_forwards,
          "prefills": out.prefills,
          "s_per_token": median / max(int(lengths.sum()), 1),
          "s_per_forward": median / max(int(out.nfe.sum()), 1) if one_row else math.nan,
        }
      )
    return results


def time_decodes(
  model: sampler.SamplingModel,
  prompts: Sequence[Sequence[int]],
  settings: Sequence[SamplerSettings],
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

  Returns per setting: first_call_s (compile + one decode), median_s, min_s, samples_s, the
  per-sample NFE and kept lengths, and seconds per generated token (median_s / kept tokens).
  """
  decodes = DecodeRounds(model, prompts, settings, batch_size=batch_size, warm=warm, log=log)
  interleave([decodes], [], repeats=repeats, min_total_s=min_total_s, max_repeats=max_repeats)
  return decodes.result()


def interleave(
  decodes: Sequence[DecodeRounds],
  loops: Sequence[ForwardLoops],
  *,
  repeats: int,
  loop_repeats: int = 0,
  min_total_s: float = 0.0,
  max_repeats: int = 201,
) -> None:
  """Time prepared decodes and forward loops in the same rounds, so that a machine slowing
  down for a while slows every measurement alike rather than whichever ran then.

  Decodes get at least `repeats` rounds and go on, up to `max_repeats`, until each setting has
  `min_total_s` of timed calls. Forward loops run in every round in which some decode does, and
  on their own after the decodes until they have `loop_repeats`: at least as many samples as
  any decode, so that the fastest of each (`fastest`) is drawn from at least as many calls.
  (With short decodes among `decodes`, such as `decode_speed`'s one-token calls, that is many
  more: the tiny model's time(n) loops got 201 rounds where its 256-token decodes got 24.)
  """
  loop_repeats = max(repeats, loop_repeats)

  def wanted(d: DecodeRounds) -> bool:
    short = d.least_timed_s < min_total_s
    return d.rounds < repeats or (short and d.rounds < max_repeats)

  while (busy := [d for d in decodes if wanted(d)]) or any(
    lp.rounds < loop_repeats for lp in loops
  ):
    for d in busy:
      d.round()
    for lp in loops:
      if busy or lp.rounds < loop_repeats:
        lp.round()


def describe(s: SamplerSettings) -> str:
  if s.mode == "ntp":
    return "NTP"
  return f"SBD {s.rule} γ={s.gamma:g} k={s.block_size}" + (" lockstep" if s.lockstep else "")
