"""Timing whole decodes: the same prompts decoded with each setting, round-robin, and the
rounds that interleave decodes with time(n) loops (`forward_timing`) so that a machine slowing
down for a while slows every measurement alike. Decodes report their median and fastest timed
call (`min_s`), and the forwards and tokens of the latest timed call (a verified decode's
choices depend on what earlier calls learned: `decode.acceptance_prior.Prior`); compilation is
excluded and reported apart. Each setting decodes with a prior of its own, as in a process that decodes
only it: the model's priors are kept per way of drafting, which a verified decode and the same
decode drafting its widest share.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.forward_timing import ForwardLoops, SteppedForwardLoops
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import SamplerSettings


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
    self.prompts, self.settings = prompts, list(settings)
    # The same weights, each setting's own priors (`sampler.SamplingModel.prior_for`).
    self.models = [dataclasses.replace(model, priors={}) for _ in self.settings]
    self.batch_size, self.warm, self.min_bucket = batch_size, warm, min_bucket
    self.cache_length = cache_length
    self.outs, self.first = [], []
    for i, s in enumerate(self.settings):
      t0 = time.perf_counter()
      self.outs.append(self._decode(i))
      self.first.append(time.perf_counter() - t0)
      log(f"[timing] compiled + first decode {describe(s)}: {self.first[-1]:.2f}s")
    self.samples: list[list[float]] = [[] for _ in self.settings]

  def _decode(self, i: int) -> sampler.DecodeOutput:
    return sampler.decode(
      self.models[i],
      self.prompts,
      self.settings[i],
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
    for i, samples in enumerate(self.samples):
      if self.warm:
        self._decode(i)
      t0 = time.perf_counter()
      self.outs[i] = self._decode(i)  # what is reported: the latest timed call's decode
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
          "batch_ntp_forwards": out.batch_ntp_forwards.tolist(),
          "batch_kind_forwards": out.batch_kind_forwards.tolist(),
          "draft_widths": list(s.draft_widths),
          "cost_table": None if out.cost_table is None else out.cost_table.as_dict(),
          "lengths": lengths.tolist(),
          "tokens": int(lengths.sum()),
          "forwards": int(out.nfe.sum()),
          "loop_forwards": out.forwards,
          "loop_wide_forwards": out.wide_forwards,
          "loop_ntp_forwards": out.ntp_forwards,
          "prefills": out.prefills,
          # of the calls, those that ran NTP's program (`sampler.DecodeOutput.ntp_calls`)
          "ntp_calls": out.ntp_calls,
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
  program, and on a CPU pays for caches that program evicted (for a small model as much as a
  whole decode). Rounds go on past `repeats`, up to
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
  loops: Sequence[ForwardLoops | SteppedForwardLoops],
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
  any decode, so that the fastest of each (`fastest`) is drawn from at least as many calls
  (with short decodes among `decodes`, such as `decode_speed`'s one-token calls, many more).
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
