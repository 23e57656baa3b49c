"""What the decode loop costs per forward, against the forward alone: issue 11's "a loop that
costs no more than its forwards", measured without the per-call costs that a whole decode's
tokens per second includes.

    python -m sbd_jax.benchmarks.loop_cost --out=DIR [--models=tiny] [--prompt_len=16]
        [--max_new_tokens=256] [--repeats=7] [--concurrent_schedule]

A decode's cost per forward is a slope between two decodes that differ only in how many
forwards they run, so what a call costs once (host-side batching, dispatch, the prefill,
reading back) cancels. Batch 1, random weights, EOS off (`decode_speed`'s models), R =
--max_new_tokens, a prompt bucket of L slots:

- NTP: decodes of R and R/2 tokens. (T(R) - T(R/2)) / (R/2) is what a forward of the longer
  decode's second half costs; against time(1) over the longer decode's cache, filled to the
  mean of those forwards (L + 3R/4).
- SBD later passes (the P block tokens over the cache, P = 16): fixed schedules of r = 1 and
  r = 2 tokens per forward, the same R and cache. They run the same prefill and first passes;
  r = 1 runs 8 more later passes per block. (T(r=1) - T(r=2)) / (their difference in later
  passes) against time(16) at the mean fill of the cache (L + R/2).

decode / loop = 1: the loop costs its forwards and nothing else (the reveal rule, the
bookkeeping and the loop itself are free). time(n) runs causal forwards; a later pass's block
is bidirectional, which cost time(16) 0-6 % more in an A/B on the tiny model. Decodes and
time(n) loops are timed in the same rounds (`wallclock.interleave`). Writes DIR/results.json
and DIR/loop_cost.md.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags

from sbd_jax import cli, sampler
from sbd_jax.benchmarks import decode_speed, markdown, wallclock
from sbd_jax.model import count_params

BLOCK = 16


def check_new_tokens(max_new_tokens: int) -> None:
  """R must split into whole blocks, at least two (the NTP half-length decode's R/2 >= P)."""
  if max_new_tokens < 2 * BLOCK or max_new_tokens % BLOCK:
    raise ValueError(
      f"--max_new_tokens={max_new_tokens}: needs a multiple of {BLOCK}, at least {2 * BLOCK}"
    )


def loop_cost(
  name: str, prompt_len: int, max_new_tokens: int, repeats: int, min_total_s: float = 1.0
) -> dict[str, Any]:
  """One model's per-forward decode costs and time(1), time(P) (see the module docstring);
  each decode is timed `repeats` times and for `min_total_s` at least."""
  check_new_tokens(max_new_tokens)
  cfg = decode_speed.model_config(name)
  model = decode_speed.random_model(cfg)
  base = sampler.SamplerSettings(
    eos_id=-1, mask_id=cfg.vocab_size - 1, pad_id=0, block_size=BLOCK, max_new_tokens=max_new_tokens
  )
  settings = [
    base.replace(mode="ntp"),
    base.replace(mode="ntp", max_new_tokens=max_new_tokens // 2),
    base.replace(rule="fixed", gamma=1.0),
    base.replace(rule="fixed", gamma=2.0),
  ]
  prompt = np.random.default_rng(0).integers(1, min(cfg.vocab_size - 1, 256), (1, prompt_len))
  slots = sampler.prompt_bucket(prompt_len)
  quiet = dict(batch_size=1, warm=True, log=lambda _: None)
  decodes = wallclock.DecodeRounds(model, prompt.tolist(), settings, **quiet)
  ntp_loop = wallclock.ForwardLoops(
    model,
    batch=1,
    cache_length=settings[0].cache_slots(slots, 1),
    ns=(1,),
    inner=8,
    cached_tokens=slots + 3 * max_new_tokens // 4,
  )
  sbd_cache = settings[2].cache_slots(slots, 1)
  sbd_loop = wallclock.ForwardLoops(
    model,
    batch=1,
    cache_length=sbd_cache,
    ns=(BLOCK,),
    inner=8,
    cached_tokens=min(slots + max_new_tokens // 2, sbd_cache - BLOCK),
  )
  wallclock.interleave(
    [decodes], [ntp_loop, sbd_loop], repeats=repeats, loop_repeats=9, min_total_s=min_total_s
  )
  ntp, ntp_half, sbd1, sbd2 = decodes.result()

  def later_passes(d: dict[str, Any]) -> int:
    return d["loop_forwards"] - d["loop_wide_forwards"] - d["prefills"]

  ntp_forward = (ntp["median_s"] - ntp_half["median_s"]) / (
    ntp["loop_forwards"] - ntp_half["loop_forwards"]
  )
  extra = later_passes(sbd1) - later_passes(sbd2)
  sbd_later = (sbd1["median_s"] - sbd2["median_s"]) / extra
  time1 = ntp_loop.result()["time_s"]["1"]
  time_p = sbd_loop.result()["time_s"][str(BLOCK)]
  return {
    "model": name,
    "params": count_params(model.state),
    "prompt_len": prompt_len,
    "max_new_tokens": max_new_tokens,
    "ntp_forward_s": ntp_forward,
    "time1_s": time1,
    "ntp_over_loop": ntp_forward / time1,
    "sbd_later_pass_s": sbd_later,
    "sbd_extra_later_passes": extra,
    f"time{BLOCK}_s": time_p,
    "sbd_over_loop": sbd_later / time_p,
    "decode_median_s": {
      "ntp": ntp["median_s"],
      "ntp_half": ntp_half["median_s"],
      "sbd_r1": sbd1["median_s"],
      "sbd_r2": sbd2["median_s"],
    },
    "time_cached_tokens": {"1": ntp_loop.end, str(BLOCK): sbd_loop.end},
  }


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  header = [
    "model",
    "prompt",
    "new tokens",
    "NTP forward in the decode (µs)",
    "time(1) (µs)",
    "decode / loop",
    "SBD later pass in the decode (µs)",
    f"time({BLOCK}) (µs)",
    "decode / loop",
  ]
  body = [
    [
      f"{r['model']} ({r['params'] / 1e6:.1f}M)",
      str(r["prompt_len"]),
      str(r["max_new_tokens"]),
      f"{r['ntp_forward_s'] * 1e6:.0f}",
      f"{r['time1_s'] * 1e6:.0f}",
      f"{r['ntp_over_loop']:.2f}",
      f"{r['sbd_later_pass_s'] * 1e6:.0f}",
      f"{r[f'time{BLOCK}_s'] * 1e6:.0f}",
      f"{r['sbd_over_loop']:.2f}",
    ]
    for r in rows
  ]
  return markdown.table(header, body)


def _define_flags():
  flags.DEFINE_string("out", None, "Output directory (results.json, loop_cost.md).")
  flags.DEFINE_list("models", ["tiny"], f"Random-weight models: {', '.join(decode_speed.MODELS)}.")
  flags.DEFINE_list("prompt_lens", ["16"], "Prompt lengths (random token ids).")
  flags.DEFINE_integer("max_new_tokens", 256, f"R: a multiple of {BLOCK}, at least {2 * BLOCK}.")
  flags.DEFINE_integer("repeats", 7, "Timed repeats per decode, at least (medians).")
  decode_speed.define_schedule_flag()
  flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    prompt_lens = [int(x) for x in f.prompt_lens]
    decode_speed.check_models(f.models)
    check_new_tokens(f.max_new_tokens)
    xla_flags = decode_speed.use_schedule(f.concurrent_schedule)
  except ValueError as e:
    cli.fail(e)
  start, rows = time.perf_counter(), []
  for name in f.models:
    for prompt_len in prompt_lens:
      rows.append(loop_cost(name, prompt_len, f.max_new_tokens, f.repeats))
      r = rows[-1]
      print(
        f"[{time.perf_counter() - start:5.0f}s] {name} prompt {prompt_len}: NTP forward "
        f"{r['ntp_over_loop']:.2f} x time(1), SBD later pass {r['sbd_over_loop']:.2f} x "
        f"time({BLOCK})",
        file=sys.stderr,
        flush=True,
      )
  results = {
    "device": str(jax.devices()[0].device_kind),
    "cpu_cores": len(os.sched_getaffinity(0)),
    "xla_flags": xla_flags,
    "seconds": time.perf_counter() - start,
    "rows": rows,
  }
  table = format_markdown(rows)
  markdown.save(f.out, "loop_cost", results, table)
  print(table)


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
