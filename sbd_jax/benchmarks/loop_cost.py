"""What the decode loop costs per forward, against the forward alone: issue 11's "a loop that
costs no more than its forwards", measured without the per-call costs that a whole decode's
tokens per second includes.

    python -m sbd_jax.benchmarks.loop_cost --out=DIR [--models=tiny] [--prompt_len=16]
        [--max_new_tokens=256] [--repeats=7] [--concurrent_schedule]

A decode's cost per forward is a slope between two decodes that differ only in how many
forwards they run, so what a call costs once (host-side batching, dispatch, the prefill,
reading back) cancels. Batch 1, random weights, EOS off (`decode_speed`'s models), R =
--max_new_tokens, a prompt bucket of L slots, every decode over the same cache of L + R slots
(a shorter decode over a cache of its own would read fewer or smaller attention chunks in the
forwards it shares with the longer one, and the slope would charge that to the longer one's
extra forwards). time(n) is timed at the fills of the extra forwards, one per step of
attention's cost and weighted (`wallclock.fill_steps`):

- NTP: decodes of R and R/2 tokens. (T(R) - T(R/2)) / (R/2) is what a forward of the longer
  decode's second half costs; against time(1) over keys reaching (L + R/2, L + R].
- SBD later passes (the P block tokens over the cache, P = 16): fixed schedules of r = 1 and
  r = 2 tokens per forward, the same R. They run the same prefill and wide passes; r = 1 runs
  8 more later passes per block. (T(r=1) - T(r=2)) / (their difference in later passes)
  against time(P) over keys reaching (L, L + R].
- SBD wide passes (a block's first forward: the previous block, committed, and this one, 2P
  tokens): r = P, every block done in its first forward, decodes of R and R/2 tokens; the
  longer runs R/2P more wide passes, against time(2P) over keys reaching (L + R/2, L + R].
  The wide pass computes logits for its last P tokens, time(2P) for all 2P (as the paper's
  time(2k) counts a forward of 2k tokens).

decode / loop = 1: the loop costs its forwards and nothing else (the reveal rule, the
bookkeeping and the loop itself are free). time(n) runs causal forwards; a later pass's block
is bidirectional, which cost time(16) 0-6 % more in an A/B on the tiny model. Decodes and
time(n) loops are timed in the same rounds (`wallclock.interleave`); each slope is given from
medians and from fastest calls (`wallclock`). Writes DIR/results.json and DIR/loop_cost.md.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from absl import flags

from sbd_jax import cli
from sbd_jax.benchmarks import decode_speed, markdown, wallclock
from sbd_jax.decode import sampler
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.model.transformer import count_params

BLOCK = 16


def check_new_tokens(max_new_tokens: int) -> None:
  """R must split into whole blocks, at least two (the NTP half-length decode's R/2 >= P)."""
  if max_new_tokens < 2 * BLOCK or max_new_tokens % BLOCK:
    raise ValueError(
      f"--max_new_tokens={max_new_tokens}: needs a multiple of {BLOCK}, at least {2 * BLOCK}"
    )


class Part(NamedTuple):
  """One kind of forward: two decodes that differ only in how many of it they run, and the
  time(n) loops it is set against."""

  name: str  # its key in a results row
  label: str  # its name in the table
  long: SamplerSettings
  short: SamplerSettings
  count: Callable[[dict[str, Any]], int]  # forwards of this kind in a decode's result
  n: int  # time(n)
  reach: tuple[int, int]  # how far the extra forwards' keys reach: (start, end] slots


def parts(base: SamplerSettings, slots: int) -> list[Part]:
  """NTP forwards, SBD later passes and SBD wide passes (module docstring) for R =
  base.max_new_tokens after a prompt bucket of `slots`."""
  r, p = base.max_new_tokens, base.block_size
  fixed = base.replace(rule="fixed", gamma=float(p))
  return [
    # Forward t reads the bucket and t tokens, t over R/2 .. R - 1.
    Part(
      "ntp_forward",
      "NTP forward",
      base.replace(mode="ntp"),
      base.replace(mode="ntp", max_new_tokens=r // 2),
      lambda d: d["loop_forwards"],
      1,
      (slots + r // 2, slots + r),
    ),
    # r = 1 runs P - 1 later passes per block, r = 2 P/2 - 1, over every block.
    Part(
      "sbd_later_pass",
      "SBD later pass",
      base.replace(rule="fixed", gamma=1.0),
      base.replace(rule="fixed", gamma=2.0),
      lambda d: d["loop_forwards"] - d["loop_wide_forwards"] - d["prefills"],
      p,
      (slots, slots + r),
    ),
    # r = P: one wide pass per block after the first; block j's keys reach its end, j over
    # R/2P .. R/P - 1.
    Part(
      "sbd_wide_pass",
      "SBD wide pass",
      fixed,
      fixed.replace(max_new_tokens=r // 2),
      lambda d: d["loop_wide_forwards"],
      2 * p,
      (slots + r // 2, slots + r),
    ),
  ]


def loop_cost(
  name: str, prompt_len: int, max_new_tokens: int, repeats: int, min_total_s: float = 1.0
) -> dict[str, Any]:
  """One model's per-forward decode costs and time(n) (see the module docstring); each decode
  is timed `repeats` times and for `min_total_s` at least."""
  check_new_tokens(max_new_tokens)
  cfg = decode_speed.model_config(name)
  model = decode_speed.random_model(cfg)
  base = SamplerSettings(
    eos_id=-1, mask_id=cfg.vocab_size - 1, pad_id=0, block_size=BLOCK, max_new_tokens=max_new_tokens
  )
  prompt = np.random.default_rng(0).integers(1, min(cfg.vocab_size - 1, 256), (1, prompt_len))
  slots = sampler.prompt_bucket(prompt_len)
  todo = parts(base, slots)
  # Every decode over the longest one's cache: a shorter decode over a cache of its own reads
  # fewer or smaller attention chunks per forward, which the slope would charge to the longer.
  cache = max(part.long.cache_slots(slots, 1) for part in todo)
  quiet = dict(batch_size=1, warm=True, cache_length=cache, log=lambda _: None)
  settings = [s for part in todo for s in (part.long, part.short)]
  decodes = wallclock.DecodeRounds(model, prompt.tolist(), settings, **quiet)
  loops = [
    wallclock.SteppedForwardLoops(
      model, batch=1, cache_length=cache, ns=(part.n,), inner=8, reach=part.reach
    )
    for part in todo
  ]
  wallclock.interleave([decodes], loops, repeats=repeats, loop_repeats=9, min_total_s=min_total_s)
  results = decodes.result()
  row = {
    "model": name,
    "params": count_params(model.state),
    "prompt_len": prompt_len,
    "max_new_tokens": max_new_tokens,
    "cache_length": cache,
  }
  for i, (part, loop) in enumerate(zip(todo, loops)):
    long, short = results[2 * i : 2 * i + 2]
    extra = part.count(long) - part.count(short)
    time_n = loop.result()
    forward = (long["median_s"] - short["median_s"]) / extra
    fastest = (long["min_s"] - short["min_s"]) / extra
    row[part.name] = {
      "label": part.label,
      "n": part.n,
      "extra_forwards": extra,
      "decode_s": forward,
      "time_s": time_n["time_s"][str(part.n)],
      "over_loop": forward / time_n["time_s"][str(part.n)],
      "fastest_decode_s": fastest,
      "fastest_time_s": time_n["fastest_time_s"][str(part.n)],
      "fastest_over_loop": fastest / time_n["fastest_time_s"][str(part.n)],
      "cached_tokens": time_n["cached_tokens"],  # weighted over its steps
      "fill_steps": time_n["steps"][str(part.n)],  # [[cached tokens, weight, time(n)]]
      "decodes_median_s": [long["median_s"], short["median_s"]],
      "decodes_min_s": [long["min_s"], short["min_s"]],
    }
  return row


def measured_parts(row: dict[str, Any]) -> list[dict[str, Any]]:
  """A row's entries for its kinds of forward (`Part`), in the order measured."""
  return [x for x in row.values() if isinstance(x, dict) and "label" in x]


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  """One line per (row, kind of forward): medians, then fastest calls."""
  header = [
    "model",
    "prompt",
    "new tokens",
    "forward",
    "in the decode (µs)",
    "time(n) (µs)",
    "decode / loop",
    "fastest calls: decode (µs)",
    "time(n) (µs)",
    "decode / loop",
  ]
  body = []
  for r in rows:
    for x in measured_parts(r):
      body.append(
        [
          f"{r['model']} ({r['params'] / 1e6:.1f}M)",
          str(r["prompt_len"]),
          str(r["max_new_tokens"]),
          f"{x['label']}, n = {x['n']}",
          f"{x['decode_s'] * 1e6:.0f}",
          f"{x['time_s'] * 1e6:.0f}",
          f"{x['over_loop']:.2f}",
          f"{x['fastest_decode_s'] * 1e6:.0f}",
          f"{x['fastest_time_s'] * 1e6:.0f}",
          f"{x['fastest_over_loop']:.2f}",
        ]
      )
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
    xla_flags = decode_speed.use_xla_cpu_options(f.concurrent_schedule)
  except ValueError as e:
    cli.fail(e)
  start, rows = time.perf_counter(), []
  for name in f.models:
    for prompt_len in prompt_lens:
      rows.append(loop_cost(name, prompt_len, f.max_new_tokens, f.repeats))
      r = rows[-1]
      summary = ", ".join(
        f"{x['label']} {x['over_loop']:.2f} x time({x['n']}) (fastest {x['fastest_over_loop']:.2f})"
        for x in measured_parts(r)
      )
      print(
        f"[{time.perf_counter() - start:5.0f}s] {name} prompt {prompt_len}: {summary}",
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
