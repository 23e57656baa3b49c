"""Decode speed with the model taken out: generated tokens per second of NTP and SBD decoding at
known tokens per forward, next to the speedup that the measured forward times predict.

    python -m sbd_jax.benchmarks.decode_speed --out=DIR [--models=tiny,m100] [--dtype=float32]
        [--batches=1,4] [--per_forward=1,2,4,8,16] [--prompt_lens=16,256]
        [--max_new_tokens=N] [--repeats=3] [--workdir=/tmp/sbd_tiny --gammas=0.1,0.35] [--cpus=1]
        [--concurrent_schedule]

Weights are random (timing does not depend on what a model learned): `tiny` has the shape of
configs/tiny.py, `m100` is a ~100M-parameter Llama-style stack whose float32 weights (~400 MB)
are far beyond a CPU's last-level cache, so its one-token forward is memory-bound; `llama8b` and
`qwen3_8b` have the 8B presets' shapes (16 GB in bfloat16: an accelerator's regime). EOS is
disabled (`eos_id=-1`) and the `fixed` rule reveals exactly r tokens per forward,
so every decode generates max_new_tokens tokens and NTP and SBD differ only in the loop. With
`--workdir`, the trained model also decodes its held-out problems with the EB rule at each γ
(EOS enabled): the realistic case.

Per configuration (model, batch, prompt length, schedule): tokens per second of NTP and SBD
(medians of repeats, at least --repeats and 0.5 s of calls per setting, each timed call right
after an untimed one of the same program; compilation apart), their ratio, the speedup
predicted from time(n) measured over a cache of the decode's length, at the fills its forwards
see (`wallclock.fill_steps`; NTP: time(1) per token; SBD: time(2k) for a block's first
forward, time(k) for the others, with the forward counts the decodes' batches ran; each
decode's first forward is charged at its measured prefill time over an empty cache of the
decode's length: the prompt for NTP, the prompt plus the first block for SBD's fused forward),
and the ratio measured / predicted: 1 means the loop costs nothing beyond its forwards.
Decodes and forward loops are timed in the same rounds (`measure`). The speedups and their
ratio are also given from every timing's fastest call (`fastest_*`; why: `wallclock`).
`loop_cost` measures the loop's cost per forward alone.

A decode call also costs something once, whatever its length (host-side batching, dispatch,
reading back, a cold first forward): `call_s` measures it per mode (a one-token decode less
its forward) and `predicted_speedup_with_call` adds it to both sides, which separates what the
loop costs per forward from what a short decode pays per call. Programs are compiled with
XLA:CPU's sequential schedule and region-analysis copy insertion unless `--concurrent_schedule`
(`use_xla_cpu_options`), and `--cpus=1`
runs on one core (`use_cpus`). Outputs: DIR/results.json (`rows`), DIR/decode_speed.md,
DIR/decode_speed.png.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from absl import flags
from flax import nnx

import sbd_jax
from sbd_jax import cli
from sbd_jax import config as config_lib
from sbd_jax.benchmarks import markdown, wallclock
from sbd_jax.decode import loading, sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.evals import runner
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.model import architectures
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.model.transformer import Transformer, count_params

BLOCK = 16  # k of the fixed-schedule decodes; the trained model decodes with its own
MIN_TIMED_S = 0.5  # timed decode calls per setting, at least (`--repeats` is the minimum count)
# Repeats of the time(n) and prefill loops, at least: with 3, the trained model's time(1) came
# out at 0.105-0.142 ms in runs of the same code, and its predicted speedup at 1.37-1.61x.
MIN_FORWARD_REPEATS = 9


# The XLA:CPU options the CPU benchmarks compile with (`use_xla_cpu_options`): the schedule
# without its reordering for concurrent ops, and copy insertion with region analysis.
SEQUENTIAL_SCHEDULE = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
REGION_COPY_INSERTION = "--xla_cpu_copy_insertion_use_region_analysis=true"
XLA_CPU_OPTIONS = (SEQUENTIAL_SCHEDULE, REGION_COPY_INSERTION)

MODELS = ("tiny", "m100", "llama8b", "qwen3_8b")

# Generated tokens per decode unless --max_new_tokens: enough that a batch-1 decode is mostly
# its loop. A decode call costs about 0.5-0.9 ms on this 2-core CPU whatever its length
# (host-side batching, dispatching ~50 buffers, reading back): a fifth of a 32-token decode
# of `tiny` (3-4 ms), so its r = 8 and 16 rows read measured / predicted 0.71-0.90 from run to
# run, against 0.94-1.09 at 256 tokens, the sampler's default. A 32-token decode of m100 takes
# 0.7 s, and 256 tokens would take its grid past the benchmark's 20 minutes.
NEW_TOKENS = {"tiny": 256, "m100": 32, "llama8b": 32, "qwen3_8b": 32}


def model_config(name: str, dtype: str = "float32") -> ModelConfig:
  """The benchmark's model shapes (random weights), parameters and compute in `dtype`."""
  if name == "tiny":
    repo = os.path.dirname(os.path.dirname(sbd_jax.__file__))
    cfg = config_lib.to_model_config(config_lib.from_file(os.path.join(repo, "configs", "tiny.py")))
  elif name == "m100":
    cfg = ModelConfig(
      vocab_size=32768,
      num_layers=12,
      embed_dim=768,
      num_heads=12,
      num_kv_heads=4,
      head_dim=64,
      mlp_dim=2048,
      rope_theta=10_000.0,
      tie_embeddings=True,
    )
  elif name == "llama8b":  # 16 GB of bfloat16 weights: an accelerator's memory-bound regime
    cfg = architectures.llama3_1_8b()
  elif name == "qwen3_8b":
    cfg = architectures.qwen3_8b()
  else:
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
  # As decoding holds a model: unrolled layers, weights stored in the compute dtype.
  return cfg.replace(param_dtype=dtype, compute_dtype=dtype, scan_layers=False)


def random_model(cfg: ModelConfig) -> sampler.SamplingModel:
  return sampler.SamplingModel.of(Transformer(cfg, rngs=nnx.Rngs(params=0)))


class Measured(NamedTuple):
  """One configuration's timings (`measure`)."""

  ntp: dict[str, Any]  # wallclock.DecodeRounds.result() of the NTP decodes
  sbds: list[dict[str, Any]]  # the same per SBD setting
  times: dict[int, float]  # time(n) over the decode's cache: 1, k, 2k and any others asked for
  cached_tokens: int  # the fill time(2k) was timed at, weighted over its steps
  prefill: tuple[float, float]  # NTP's prompt forward, SBD's prompt + first block
  call: tuple[float, float]  # NTP's, SBD's cost of a decode call beyond its forwards
  fastest_times: dict[int, float]  # `times` and `prefill` from the loops' fastest calls
  fastest_prefill: tuple[float, float]
  forward: dict[str, Any]  # wallclock.ForwardLoops.result() of the time(n) loops


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
  """Time decodes and the forwards that predict them in the same rounds (`wallclock.
  interleave`), so that a slow spell of a shared machine lands on both sides of the ratio
  measured / predicted rather than on whichever was timed then. (What remains of the spread on
  a 2-core machine is a per-process state of XLA's threads: `use_cpus`.)

  - Decodes: NTP and each SBD setting, each timed call right after an untimed one, at least
    `repeats` times and for `min_total_s`. The prompts go `batch` at a time, every batch padded
    to the bucket of the longest prompt, so that one prefill time and one cache length hold
    for each.
  - time(1), time(k), time(2k) (and `ns`) over a cache as long as the decode's, at the fills
    its forwards see: one per step of attention's cost over the generated range, weighted
    (`wallclock.fill_steps`), `forward_repeats` rounds at least.
  - Prefills: NTP's prompt forward and SBD's fused prompt + first block, each over an empty
    cache of its decode's length (attention reads every slot: over a cache just long enough
    for the prompt, the trained model's prefill came out 0.4 ms, a fifth, faster).
  - Call cost: a one-token decode of the first batch (one forward, its prefill) less that
    prefill: what a loop-level prediction leaves out (host-side batching, dispatch, reading
    back, a cold first forward).
  """
  slots = sampler.prompt_bucket(max(len(p) for p in prompts))
  ntp_cache = ntp_settings.cache_slots(slots, batch)
  sbd_cache = sbd_settings[0].cache_slots(slots, batch)
  quiet = dict(batch_size=batch, warm=True, min_bucket=slots, log=lambda _: None)
  decodes = wallclock.DecodeRounds(model, prompts, [ntp_settings, *sbd_settings], **quiet)
  one = dict(max_new_tokens=1)
  calls = wallclock.DecodeRounds(
    model,
    prompts[:batch],
    [ntp_settings.replace(**one), sbd_settings[-1].replace(**one)],
    **quiet,
  )
  forwards = wallclock.SteppedForwardLoops(
    model,
    batch=batch,
    cache_length=sbd_cache,
    ns=sorted({1, block, 2 * block, *ns}),
    inner=8,
    reach=(slots, slots + generated(decodes.outs[0])),
  )
  prefills = [
    wallclock.ForwardLoops(
      model, batch=batch, cache_length=length, ns=(n,), inner=2, cached_tokens=0
    )
    for n, length in ((slots, ntp_cache), (slots + block, sbd_cache))
  ]
  wallclock.interleave(
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
  (`wallclock.fill_steps`). Timed at the mean fill alone (the bucket and half of them), the
  tiny model's time(n) had come out within 2 % of its decodes' per-forward cost with chunks of
  128; with the chunks of 176 of configs/tiny.py (session 25) a third of its 256-token decodes'
  forwards read a second chunk that the mean fill's did not."""
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
  predicted = wallclock.accounted_speedup(times, block, *counts, prefill=prefill, sbd_wide=wide)
  with_call = wallclock.accounted_speedup(
    times, block, *counts, prefill=prefill, call=call, sbd_wide=wide
  )
  measured = sbd_tps / ntp_tps
  # The same from every timing's fastest call (`wallclock`: the least disturbed estimate).
  fastest = (sbd["tokens"] / sbd["min_s"]) / (ntp["tokens"] / ntp["min_s"])
  fastest_predicted = wallclock.accounted_speedup(
    m.fastest_times, block, *counts, prefill=m.fastest_prefill, sbd_wide=wide
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
    # The same prediction with the prompt's forward left out (as in wave 1's tables).
    "predicted_speedup_without_prefill": wallclock.accounted_speedup(
      times, block, *counts, sbd_wide=wide
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
    # spread (`wallclock`) can be read back.
    "decode_samples_s": {"ntp": ntp["samples_s"], "sbd": sbd["samples_s"]},
    "time_loop_calls": {
      key: m.forward[key] for key in ("inner", "one_forward_call_s", "loop_call_s")
    },
    "batch_forwards": {"ntp": ntp["batch_forwards"][firsts], "sbd": sbd["batch_forwards"][firsts]},
    "sbd_wide_forwards": sbd["batch_wide_forwards"][firsts],
  }


def fixed_schedule_rows(
  name: str,
  cfg: ModelConfig,
  *,
  batches: Sequence[int],
  prompt_lens: Sequence[int],
  per_forward: Sequence[int],
  max_new_tokens: int,
  repeats: int,
  log,
) -> list[dict[str, Any]]:
  """Random-weight model, EOS disabled, exactly r tokens revealed per SBD forward."""
  model = random_model(cfg)
  params = count_params(model.state)
  base = SamplerSettings(
    eos_id=-1,  # no EOS: every decode runs to max_new_tokens
    mask_id=cfg.vocab_size - 1,
    pad_id=0,
    block_size=BLOCK,
    max_new_tokens=max_new_tokens,
  )
  sbd_settings = [base.replace(rule="fixed", gamma=float(r)) for r in per_forward]
  rng = np.random.default_rng(0)
  rows = []
  for prompt_len in prompt_lens:
    for batch in batches:
      prompts = rng.integers(1, min(cfg.vocab_size - 1, 256), (batch, prompt_len)).tolist()
      t0 = time.perf_counter()
      m = measure(
        model, prompts, base.replace(mode="ntp"), sbd_settings, batch=batch, repeats=repeats
      )
      for r, sbd in zip(per_forward, m.sbds):
        rows.append(row(name, params, batch, prompt_len, f"r={r}", m, sbd, max_new_tokens))
      log(
        f"{name} batch {batch} prompt {prompt_len}: NTP {rows[-1]['ntp_tokens_per_s']:.0f} tok/s; "
        + ", ".join(
          f"r={r} {x['measured_speedup']:.2f}x (pred {x['predicted_speedup']:.2f}x, "
          f"fastest {x['fastest_measured_over_predicted']:.2f} of pred)"
          for r, x in zip(per_forward, rows[-len(per_forward) :])
        )
        + f" [{time.perf_counter() - t0:.0f} s]"
      )
  return rows


def trained_rows(
  workdir: str, *, batches: Sequence[int], gammas: Sequence[float], repeats: int, log
) -> list[dict[str, Any]]:
  """The trained model on its held-out problems, EB entropy rule, EOS enabled, decoded with the
  block size it was trained for (`sample.block_size`): a larger block than training's reveals
  positions the model never learned, and its answers end early."""
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  params = count_params(model.state)
  block = config.sample.block_size
  rows = []
  for batch in batches:
    problems = arithmetic_task.problems(config.data, batch, seed=0)
    budget = runner.reference_budget(problems, tokenizer, block)
    base = settings_lib.from_config(config.sample, tokenizer, mask_id, budget=budget)
    limit = base.max_new_tokens
    sbd_settings = [base.replace(rule="eb_entropy", gamma=float(g)) for g in gammas]
    prompts = [tokenizer.encode_document(p.plain_prompt) for p in problems]
    m = measure(
      model, prompts, base.replace(mode="ntp"), sbd_settings, batch=batch, repeats=repeats,
      block=block,
    )  # fmt: skip
    longest = max(len(p) for p in prompts)
    for g, sbd in zip(gammas, m.sbds):
      schedule = f"eb_entropy γ={g:g} k={block}"
      rows.append(row("trained", params, batch, longest, schedule, m, sbd, limit, block))
    log(
      f"trained batch {batch}: NTP {rows[-1]['ntp_tokens_per_s']:.0f} tok/s; "
      + ", ".join(
        f"γ={g:g} {x['measured_speedup']:.2f}x (pred {x['predicted_speedup']:.2f}x, "
        f"fastest {x['fastest_measured_over_predicted']:.2f} of pred)"
        for g, x in zip(gammas, rows[-len(gammas) :])
      )
    )
  return rows


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  header = [
    "model",
    "batch",
    "prompt",
    "new tokens",
    "schedule",
    "tokens / forward",
    "NTP tok/s",
    "SBD tok/s",
    "measured",
    "predicted",
    "measured / predicted",
    "call ms (NTP, SBD)",
    "measured / (predicted with call)",
    "fastest calls: measured",
    "predicted",
    "measured / predicted",
  ]
  body = [
    [
      f"{r['model']} ({r['params'] / 1e6:.1f}M)",
      str(r["batch"]),
      str(r["prompt_len"]),
      str(r["max_new_tokens"]),
      r["schedule"],
      f"{r['tokens_per_forward']:.2f}",
      f"{r['ntp_tokens_per_s']:.0f}",
      f"{r['sbd_tokens_per_s']:.0f}",
      f"{r['measured_speedup']:.2f}x",
      f"{r['predicted_speedup']:.2f}x",
      f"{r['measured_over_predicted']:.2f}",
      f"{r['call_s']['ntp'] * 1e3:.2f}, {r['call_s']['sbd'] * 1e3:.2f}",
      f"{r['measured_over_predicted_with_call']:.2f}",
      f"{r['fastest_measured_speedup']:.2f}x",
      f"{r['fastest_predicted_speedup']:.2f}x",
      f"{r['fastest_measured_over_predicted']:.2f}",
    ]
    for r in rows
  ]
  return markdown.table(header, body)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
  """Speedup against tokens per forward, one panel per (model, prompt length), one line per
  batch size: measured (solid) and predicted (dashed)."""
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional: the [plot] extra)

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fixed = [r for r in rows if r["schedule"].startswith("r=")]
  panels = sorted({(r["model"], r["prompt_len"]) for r in fixed})
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
  for ax, (model, prompt_len) in zip(axes[0], panels):
    mine = [r for r in fixed if (r["model"], r["prompt_len"]) == (model, prompt_len)]
    for i, batch in enumerate(sorted({r["batch"] for r in mine})):
      line = sorted((r for r in mine if r["batch"] == batch), key=lambda r: r["tokens_per_forward"])
      xs = [r["tokens_per_forward"] for r in line]
      ax.plot(xs, [r["measured_speedup"] for r in line], "o-", color=f"C{i}", label=f"B={batch}")
      ax.plot(xs, [r["predicted_speedup"] for r in line], "x--", color=f"C{i}", alpha=0.6)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{model} ({mine[0]['params'] / 1e6:.1f}M), prompt {prompt_len}")
    ax.set_xlabel("tokens revealed per forward")
    ax.set_ylabel("SBD / NTP tokens per second")
    ax.grid(alpha=0.3)
  axes[0][0].legend(title="solid measured, dashed predicted", fontsize=7, title_fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def use_cpus(count: int) -> list[int]:
  """Restrict this process to its first `count` CPU cores (0: leave it as it is); returns the
  cores it runs on. Must run before JAX starts its CPU backend, which sizes its thread pool to
  the cores the process may use.

  On a 2-core machine XLA runs a small model's forward as a chain of tiny ops that its two
  threads take turns at, so every step can cross cores, and about one process in four runs
  them 20-30 % slower throughout. On one core the trained README model decodes faster (NTP
  6700-7490 against 5590-7120 tokens/s) and its time(n) is steadier (time(1) 97-101 µs in
  three processes, against 104-143 µs on two). A larger model's matmuls use both cores: m100
  runs at about 60 % of its 2-core speed on one."""
  cores = sorted(os.sched_getaffinity(0))
  if not count:
    return cores
  if not 0 < count <= len(cores):
    raise ValueError(f"--cpus={count}: this process may use {len(cores)} cores")
  _before_backend("--cpus")
  os.sched_setaffinity(0, cores[:count])
  return cores[:count]


def use_xla_cpu_options(defaults: bool) -> str:
  """Compile every program with `XLA_CPU_OPTIONS`, or with XLA:CPU's defaults (`defaults`,
  `--concurrent_schedule`); returns the XLA_FLAGS in force. Must run before JAX starts its CPU
  backend. Neither option changes a computed value (a decode's tokens are the same bit for bit).

  - The sequential schedule. By default XLA:CPU orders a program's ops so that its executor can
    run independent ones on several threads at once. A small model's forward is a chain of small
    ops: on two cores that buys little and costs hand-offs between threads, more in some programs
    than in others. In runs alternating the two schedules (BENCHMARKS.md, session 20), the random
    tiny model's time(1) was 100-106 µs under XLA's default and 71-76 µs under the sequential
    one, and at batch 1 measured / predicted rose from 0.74-1.01 to 0.84-0.99 (the trained README
    model: from 0.71-0.89 in 14 processes to 0.86-1.11 in 10). m100's NTP decoding ran 9-17 %
    faster under it as well (pair by pair), and its ratio stayed within 0.89-1.08 under either.
  - Copy insertion with region analysis, which proves more buffers inside while loops safe to
    update in place. On the tiny model's SBD decode after a 256-token prompt it leaves 122
    copies in the program instead of 156 (6 instead of 8 at the top of a later pass), the
    process makes 0.22-0.25 voluntary context switches per later pass instead of 1.17 (XLA:CPU's
    executor no longer hands each forward to its second thread), and SBD decodes 7-9 % faster
    at r = 1 and 4 while time(16) moves less than 3 %, in three alternated pairs of processes
    (BENCHMARKS.md, session 28)."""
  if defaults:
    return os.environ.get("XLA_FLAGS", "")
  _before_backend("XLA:CPU's sequential schedule and region analysis")
  flags_now = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join([flags_now, *XLA_CPU_OPTIONS]).strip()
  return os.environ["XLA_FLAGS"]


def _before_backend(flag: str) -> None:
  from jax._src import xla_bridge  # the only way to ask whether a backend exists yet

  if xla_bridge.backends_are_initialized():
    raise ValueError(f"{flag} must take effect before JAX starts its CPU backend")


def _define_flags():
  flags.DEFINE_string("out", None, "Output directory (results.json, decode_speed.md/.png).")
  flags.DEFINE_list("models", ["tiny", "m100"], f"Random-weight models: {', '.join(MODELS)}.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and compute dtype.")
  flags.DEFINE_list("batches", ["1", "4"], "Batch sizes (the issue's full grid: 1,4,16,64).")
  flags.DEFINE_list("per_forward", ["1", "2", "4", "8", "16"], "Fixed tokens per SBD forward.")
  flags.DEFINE_list("prompt_lens", ["16", "256"], "Prompt lengths (random token ids).")
  flags.DEFINE_integer(
    "max_new_tokens", None, "Generated tokens per decode (EOS disabled); default: NEW_TOKENS."
  )
  flags.DEFINE_integer("repeats", 3, "Timed repeats per decode (median reported).")
  flags.DEFINE_string("workdir", None, "A trained workdir: adds EB-rule rows on its problems.")
  flags.DEFINE_list("gammas", ["0.1", "0.35"], "γ of the EB rows (with --workdir).")
  flags.DEFINE_integer(
    "cpus", 0, "Run on this many of the process's CPU cores (0: all); see `use_cpus`."
  )
  define_schedule_flag()
  flags.mark_flags_as_required(["out"])


def define_schedule_flag() -> None:
  """--concurrent_schedule, for each CPU benchmark that compiles through `use_xla_cpu_options`."""
  flags.DEFINE_bool(
    "concurrent_schedule",
    False,
    "Compile with XLA:CPU's defaults (its concurrent schedule, copy insertion without region "
    "analysis); see `decode_speed.use_xla_cpu_options`.",
  )


def check_models(names: Sequence[str]) -> None:
  """A ValueError for an unknown model name, before any timing."""
  for name in names:
    model_config(name)


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    ints = {k: [int(x) for x in getattr(f, k)] for k in ("batches", "per_forward", "prompt_lens")}
    configs = {name: model_config(name, f.dtype) for name in f.models}
    if f.max_new_tokens is not None and f.max_new_tokens < 1:
      raise ValueError(f"--max_new_tokens={f.max_new_tokens}: a decode needs at least 1 token")
    if any(r < 1 or r > BLOCK for r in ints["per_forward"]):
      raise ValueError(f"--per_forward values must be in [1, {BLOCK}]")
    cores = use_cpus(f.cpus)
    xla_flags = use_xla_cpu_options(f.concurrent_schedule)
  except ValueError as e:
    cli.fail(e)
  os.makedirs(f.out, exist_ok=True)
  start = time.perf_counter()

  def log(message: str) -> None:
    print(f"[{time.perf_counter() - start:6.0f}s] {message}", file=sys.stderr, flush=True)

  log(f"devices: {jax.devices()} on {len(cores)} CPU cores; XLA_FLAGS={xla_flags!r}")
  rows = []
  new_tokens = {name: f.max_new_tokens or NEW_TOKENS[name] for name in configs}
  for name, cfg in configs.items():
    rows += fixed_schedule_rows(
      name,
      cfg,
      max_new_tokens=new_tokens[name],
      repeats=f.repeats,
      log=log,
      **ints,
    )
  if f.workdir:
    gammas = [float(g) for g in f.gammas]
    rows += trained_rows(
      f.workdir, batches=ints["batches"], gammas=gammas, repeats=f.repeats, log=log
    )
  results = {
    "device": str(jax.devices()[0].device_kind),
    "dtype": f.dtype,
    "block_size": BLOCK,
    "max_new_tokens": new_tokens,  # per model (the trained model: its problems' limit)
    "repeats": f.repeats,
    "cpu_cores": len(os.sched_getaffinity(0)),
    "xla_flags": xla_flags,
    "seconds": time.perf_counter() - start,
    "rows": rows,
  }
  table = format_markdown(rows)
  markdown.save(f.out, "decode_speed", results, table, lambda path: plot(rows, path))
  print(table)
  log(f"wrote {f.out}/results.json, decode_speed.md, decode_speed.png")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
