"""NTP and SBD decodes of the same prompts timed side by side, next to the speedup that their
forward times predict.

`measure` times the decodes, time(1), time(k), time(2k) over the decodes' own cache, the
prefills and each decode call's fixed cost in the same rounds (`decode_timing.interleave`);
`row` turns one SBD setting's timings into its numbers: tokens per second of both, their ratio,
the prediction from the decodes' forward counts (`prediction.accounted_speedup`), and measured /
predicted (1: the loop costs nothing beyond its forwards). Every speedup is also given from
each timing's fastest call (`fastest_*`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from benchmarks import decode_timing, forward_timing, prediction
from sbd_jax.decode import sampler

BLOCK = 16  # k of the fixed-schedule decodes; a trained model decodes with its own
MIN_TIMED_S = 0.5  # timed decode calls per setting, at least (`repeats` is the minimum count)
MIN_FORWARD_REPEATS = 9  # rounds of the time(n) and prefill loops, at least


class Measured(NamedTuple):
  """One configuration's timings (`measure`)."""

  ntp: dict[str, Any]  # decode_timing.DecodeRounds.result() of the NTP decodes
  sbds: list[dict[str, Any]]  # the same per SBD setting
  times: dict[int, float]  # time(n) over the decode's cache: 1, k, 2k and any others asked for
  cached_tokens: int  # the fill time(2k) was timed at, weighted over its steps
  prefill: tuple[float, float]  # NTP's prompt forward, SBD's prompt + first block
  call: tuple[float, float]  # NTP's, SBD's cost of a decode call beyond its forwards
  fastest_times: dict[int, float]  # `times` and `prefill` from the loops' fastest calls
  fastest_prefill: tuple[float, float]
  forward: dict[str, Any]  # forward_timing.ForwardLoops.result() of the time(n) loops


def measure(
  model,
  prompts,
  ntp_settings,
  sbd_settings,
  *,
  batch: int,
  repeats: int,
  block: int = BLOCK,
  ns: Sequence[int] = (),
  min_total_s: float = MIN_TIMED_S,
  forward_repeats: int = MIN_FORWARD_REPEATS,
) -> Measured:
  """Time decodes and the forwards that predict them in the same rounds
  (`decode_timing.interleave`), so that a slow spell of a shared machine lands on both sides of
  the ratio measured / predicted rather than on whichever was timed then.

  - Decodes: NTP and each SBD setting, each timed call right after an untimed one, at least
    `repeats` times and for `min_total_s`. The prompts go `batch` at a time, every batch padded
    to the bucket of the longest prompt, so that one prefill time and one cache length hold
    for each.
  - time(1), time(k), time(2k) (and `ns`) over a cache as long as the decode's, at the fills
    its forwards see: one per step of attention's cost over the generated range, weighted
    (`forward_timing.fill_steps`), `forward_repeats` rounds at least.
  - Prefills: NTP's prompt forward and SBD's fused prompt + first block, each over an empty
    cache of its decode's length (attention reads every slot of it, as the decode's does).
  - Call cost: a one-token decode of the first batch (one forward, its prefill) less that
    prefill: what a loop-level prediction leaves out (host-side batching, dispatch, reading
    back, a cold first forward).
  """
  slots = sampler.prompt_bucket(max(len(p) for p in prompts))
  ntp_cache = ntp_settings.cache_slots(slots, batch)
  sbd_cache = sbd_settings[0].cache_slots(slots, batch)
  quiet = dict(batch_size=batch, warm=True, min_bucket=slots, log=lambda _: None)
  decodes = decode_timing.DecodeRounds(model, prompts, [ntp_settings, *sbd_settings], **quiet)
  one = dict(max_new_tokens=1)
  calls = decode_timing.DecodeRounds(
    model,
    prompts[:batch],
    [ntp_settings.replace(**one), sbd_settings[-1].replace(**one)],
    **quiet,
  )
  widths = {d for s in sbd_settings for d in s.draft_widths}
  forwards = forward_timing.SteppedForwardLoops(
    model,
    batch=batch,
    cache_length=sbd_cache,
    ns=sorted({1, block, 2 * block, *(2 * d for d in widths), *ns}),
    inner=8,
    reach=(slots, slots + generated(decodes.outs[0])),
  )
  prefills = [
    forward_timing.ForwardLoops(
      model, batch=batch, cache_length=length, ns=(n,), inner=2, cached_tokens=0
    )
    for n, length in ((slots, ntp_cache), (slots + block, sbd_cache))
  ]
  decode_timing.interleave(
    [decodes, calls], [forwards, *prefills], repeats=repeats,
    loop_repeats=forward_repeats, min_total_s=min_total_s,
  )  # fmt: skip
  ntp, *sbds = decodes.result()
  loops = forwards.result()
  prefill_loops = [p.result() for p in prefills]

  def forward_times(key: str):
    times = {int(n): t for n, t in loops[key].items()}
    return times, tuple(next(iter(p[key].values())) for p in prefill_loops)

  times, prefill = forward_times("time_s")
  one_ntp, one_sbd = calls.result()
  call = (max(one_ntp["median_s"] - prefill[0], 0.0), max(one_sbd["median_s"] - prefill[1], 0.0))
  return Measured(
    ntp, sbds, times, loops["cached_tokens"], prefill, call, *forward_times("fastest_time_s"), loops
  )


def generated(ntp: sampler.DecodeOutput) -> int:
  """Tokens a decode generates on average (`ntp`'s): its forwards' keys reach from the prompt
  bucket to that many slots past it, and time(n) is timed over that range
  (`forward_timing.fill_steps`)."""
  return max(int(np.mean([len(t) for t in ntp.tokens])), 1)


def row(
  name: str,
  params: int,
  batch: int,
  prompt_len: int,
  schedule: str,
  m: Measured,
  sbd: dict[str, Any],
  max_new_tokens: int,
  block: int = BLOCK,
) -> dict[str, Any]:
  """One configuration's numbers (see the module docstring): `m`'s NTP decodes and forward
  times, and `sbd`, one of its SBD settings' decodes, each of at most `max_new_tokens`."""
  ntp, times, prefill, call = m.ntp, m.times, m.prefill, m.call
  ntp_tps, sbd_tps = ntp["tokens"] / ntp["median_s"], sbd["tokens"] / sbd["median_s"]
  # Wall-clock follows the batch's forwards, not its rows' own NFE: a batch runs until its
  # slowest row is done (and in lockstep waits at every block for its slowest row). So the
  # prediction counts, per batch, the forwards it ran and how many of them were 2k wide.
  firsts = slice(0, None, batch)
  longest = [max(sbd["lengths"][i : i + batch]) for i in range(0, len(sbd["lengths"]), batch)]
  counts = (
    np.asarray(ntp["batch_forwards"][firsts]),
    np.asarray(sbd["batch_forwards"][firsts]),
    np.asarray(longest),
  )
  wide = np.asarray(sbd["batch_wide_forwards"][firsts])
  shapes = dict(
    sbd_wide=wide,
    sbd_ntp=np.asarray(sbd["batch_ntp_forwards"][firsts]),
    sbd_kinds=np.asarray(sbd["batch_kind_forwards"])[firsts],
    widths=tuple(sbd["draft_widths"]),
  )
  predicted = prediction.accounted_speedup(times, block, *counts, prefill=prefill, **shapes)
  with_call = prediction.accounted_speedup(
    times, block, *counts, prefill=prefill, call=call, **shapes
  )
  measured = sbd_tps / ntp_tps
  # The same from every timing's fastest call (the least disturbed estimate).
  fastest = (sbd["tokens"] / sbd["min_s"]) / (ntp["tokens"] / ntp["min_s"])
  fastest_predicted = prediction.accounted_speedup(
    m.fastest_times, block, *counts, prefill=m.fastest_prefill, **shapes
  )
  return {
    "model": name,
    "params": params,
    "batch": batch,
    "prompt_len": prompt_len,
    "max_new_tokens": max_new_tokens,
    "schedule": schedule,
    "tokens_per_forward": sbd["tokens"] / max(sbd["forwards"], 1),
    "nfe_speedup": ntp["forwards"] / max(sbd["forwards"], 1),
    "ntp_tokens_per_s": ntp_tps,
    "sbd_tokens_per_s": sbd_tps,
    "measured_speedup": measured,
    "predicted_speedup": predicted,
    "measured_over_predicted": measured / predicted,
    "fastest_measured_speedup": fastest,
    "fastest_predicted_speedup": fastest_predicted,
    "fastest_measured_over_predicted": fastest / fastest_predicted,
    # The same prediction plus each decode call's cost beyond its forwards (`call_s`).
    "predicted_speedup_with_call": with_call,
    "measured_over_predicted_with_call": measured / with_call,
    # The same prediction with the prompt's forward left out.
    "predicted_speedup_without_prefill": prediction.accounted_speedup(
      times, block, *counts, **shapes
    ),
    "ntp_compile_s": max(ntp["first_call_s"] - ntp["median_s"], 0.0),
    "sbd_compile_s": max(sbd["first_call_s"] - sbd["median_s"], 0.0),
    "time_s": {str(n): t for n, t in times.items()},
    "fastest_time_s": {str(n): t for n, t in m.fastest_times.items()},
    "time_cached_tokens": m.cached_tokens,
    "time_fill_steps": m.forward["steps"],  # {n: [[cached tokens, weight, time(n)]]}
    "prefill_s": {"ntp": prefill[0], "sbd": prefill[1]},
    "fastest_prefill_s": {"ntp": m.fastest_prefill[0], "sbd": m.fastest_prefill[1]},
    "call_s": {"ntp": call[0], "sbd": call[1]},
    # Every timed call of both decodes and of the time(n) loops, so that how widely they
    # spread (`forward_timing`) can be read back.
    "decode_samples_s": {"ntp": ntp["samples_s"], "sbd": sbd["samples_s"]},
    "time_loop_calls": {
      key: m.forward[key] for key in ("inner", "one_forward_call_s", "loop_call_s")
    },
    "batch_forwards": {"ntp": ntp["batch_forwards"][firsts], "sbd": sbd["batch_forwards"][firsts]},
    "sbd_wide_forwards": sbd["batch_wide_forwards"][firsts],
    "sbd_ntp_forwards": sbd["batch_ntp_forwards"][firsts],
    # Forwards by kind (NTP's, then each draft width's) per batch, and the widths; what each
    # costs by time(n): time(2D) / time(1); the cost table the decode chose its forwards by.
    "sbd_kind_forwards": np.asarray(sbd["batch_kind_forwards"])[firsts].tolist(),
    "draft_widths": sbd["draft_widths"],
    "wide_over_one": {str(d): times[2 * d] / times[1] for d in sbd["draft_widths"]},
    "cost_table": sbd["cost_table"],
    # Of the latest timed decode's calls (one a batch), those run as NTP's program.
    "sbd_ntp_calls": sbd["ntp_calls"],
  }
