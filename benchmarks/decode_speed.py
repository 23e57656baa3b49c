"""Decode speed with the model taken out: generated tokens per second of NTP and SBD decoding at
known tokens per forward, next to the speedup that the measured forward times predict.

    python -m benchmarks.decode_speed --out=DIR [--models=tiny,m100] [--dtype=float32]
        [--batches=1,4] [--per_forward=1,2,4,8,16] [--prompt_lens=16,256]
        [--max_new_tokens=N] [--repeats=3] [--workdir=/tmp/sbd_tiny --gammas=0.1,0.35
        --task=exact --data=HELD_OUT.jsonl --wide_costs=8 --problems=16] [--cpus=1]
        [--concurrent_schedule]

Weights are random (timing does not depend on what a model learned): `tiny` has the shape of
configs/tiny.py, `m100` is a ~100M-parameter Llama-style stack whose float32 weights (~400 MB)
are far beyond a CPU's last-level cache, so its one-token forward is memory-bound; `llama8b` and
`qwen3_8b` have the 8B presets' shapes (16 GB in bfloat16: an accelerator's regime). EOS is
disabled (`eos_id=-1`) and the `fixed` rule reveals exactly r tokens per forward, so every
decode generates max_new_tokens tokens and NTP and SBD differ only in the loop. With
`--workdir`, the trained model also decodes held-out problems (EOS enabled; `--task`, `--data`
for a JSONL task): plain SBD with the EB rule at each γ, and verified (NTP's text) as it decodes
by default (each forward chosen by the costs the decode measures, `decode.costs`), with every
forward of the block's width (`--noadaptive`), at each `--wide_costs` value
(`SamplerSettings.wide_cost`: a fixed cost of the block's wide forward in one-token forwards in
place of the measured ones), and checked per block at each γ: the realistic case. The table
gives what each width's wide forward costs, time(2D) / time(1) from its forward times, and
results.json each verified decode's own cost table.

Per configuration (model, batch, prompt length, schedule), `side_by_side` gives tokens per
second of NTP and SBD, their ratio, the speedup predicted from time(n) and the decodes' own
forward counts, and measured / predicted; a decode call's fixed cost (`call_s`) apart. CPU
programs compile with `xla_cpu`'s options unless `--concurrent_schedule`; `--cpus=1` runs on
one core. Outputs: DIR/results.json (`rows`), DIR/decode_speed.md, DIR/decode_speed.png.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags
from flax import nnx

import sbd_jax
from benchmarks import report, xla_cpu
from benchmarks.side_by_side import BLOCK, measure, row
from sbd_jax import cli
from sbd_jax import config as config_lib
from sbd_jax.decode import sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.evals import runner
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.evals.tasks import registry
from sbd_jax.model import architectures
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.model.transformer import Transformer, count_params
from sbd_jax.run import loading

MODELS = ("tiny", "m100", "llama8b", "qwen3_8b")

# Generated tokens per decode unless --max_new_tokens: enough that a batch-1 decode of `tiny` is
# mostly its loop rather than the fixed cost of a decode call; the larger models' forwards
# dominate sooner, and 32 tokens keep their grids within minutes.
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
    verify=False,  # a forced schedule: exactly r tokens kept per forward
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


def trained_decodings(
  base: SamplerSettings, gammas: Sequence[float], wide_costs: Sequence[float] = ()
) -> list[SamplerSettings]:
  """Plain SBD at each γ (EB entropy); verified as it decodes by default (every masked position
  drafted, checked at every forward, each forward chosen by measured costs), with every forward
  the block's (`adaptive` off), at each of `wide_costs`, and checked per block with the EB rule
  at each γ (`check_every_forward` off: a block's draft checked by the next block's first
  forward)."""
  plain = [base.replace(rule="eb_entropy", gamma=float(g), verify=False) for g in gammas]
  verified = base.replace(verify=True, draft="all", check_every_forward=True)
  per_block = [
    s.replace(verify=True, draft="rule", check_every_forward=False, adaptive=False) for s in plain
  ]
  costed = [verified.replace(wide_cost=float(c)) for c in wide_costs]
  return plain + [verified, verified.replace(adaptive=False), *costed] + per_block


def schedule_name(s: SamplerSettings, block: int) -> str:
  """How a row names a trained decode: `eb_entropy γ=0.1 k=4`, `verified k=4`,
  `verified k=4, widest`, `verified k=4, wide_cost 8`,
  `eb_entropy γ=0.1 k=4 verified checked per block`."""
  if s.verified and s.draft == "all":
    cost = "" if s.wide_cost == 0 else f", wide_cost {s.wide_cost:g}"
    return f"verified k={block}" + ("" if s.adaptive else ", widest") + cost
  name = settings_lib.decoding_name(s.rule, s.gamma, block, s.verified)[len("sbd ") :]
  return name + ("" if s.check_every_forward or not s.verified else " checked per block")


def trained_rows(
  workdir: str,
  *,
  batches: Sequence[int],
  gammas: Sequence[float],
  repeats: int,
  log,
  task: str = "arithmetic",
  data: str | None = None,
  wide_costs: Sequence[float] = (),
  num_problems: int = 16,
) -> list[dict[str, Any]]:
  """The trained model on held-out problems (the run's draw of the built-in task, or the first
  of `data`'s records for another task), EOS enabled, decoded with the block size it was
  trained for (`sample.block_size`): plain and verified (`trained_decodings`) next to NTP. Each
  batch size decodes at least `num_problems` problems, `batch` at a time (rounded up to whole
  batches), so that a batch of one is timed on more than one answer."""
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  params = count_params(model.state)
  block = config.sample.block_size
  the_task = registry.get(task)
  rows = []
  for batch in batches:
    count = -(-max(num_problems, batch) // batch) * batch
    if the_task is arithmetic_task.TASK:
      problems = arithmetic_task.problems(config.data, count, seed=0)
    else:
      problems = the_task.load(data, count)
    if len(problems) % batch:
      raise ValueError(f"{len(problems)} problems do not fill batches of {batch}")
    budget = runner.reference_budget(problems, tokenizer, block)
    base = settings_lib.from_config(config.sample, tokenizer, mask_id, budget=budget)
    limit = base.max_new_tokens
    sbd_settings = trained_decodings(base, gammas, wide_costs)
    prompts = [runner.prompt_ids(p, tokenizer, None) for p in problems]
    m = measure(
      model, prompts, base.replace(mode="ntp"), sbd_settings, batch=batch, repeats=repeats,
      block=block,
    )  # fmt: skip
    longest = max(len(p) for p in prompts)
    for s, sbd in zip(sbd_settings, m.sbds):
      rows.append(
        row("trained", params, batch, longest, schedule_name(s, block), m, sbd, limit, block)
      )
    log(
      f"trained batch {batch}: NTP {rows[-1]['ntp_tokens_per_s']:.0f} tok/s; "
      + ", ".join(
        f"{x['schedule']} {x['measured_speedup']:.2f}x (pred {x['predicted_speedup']:.2f}x, "
        f"fastest {x['fastest_measured_over_predicted']:.2f} of pred)"
        for x in rows[-len(sbd_settings) :]
      )
    )
    for x in rows[-len(sbd_settings) :]:
      if x["cost_table"]:
        t = x["cost_table"]
        ms = ", ".join(f"{k} {1e3 * v:.3g} ms" for k, v in zip(t["kinds"], t["seconds"]))
        log(f"  {x['schedule']}: its costs, {t['source']}: {ms}")
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
    "time(2D) / time(1)",
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
      ", ".join(f"2x{d} {x:.2f}" for d, x in r["wide_over_one"].items()),
    ]
    for r in rows
  ]
  return report.table(header, body)


def plot(rows: Sequence[dict[str, Any]], path: str) -> report.Series:
  """Speedup against tokens per forward, one panel per (model, prompt length), one line per
  batch size: measured (solid) and predicted (dashed). Returns what it drew."""
  fixed = [r for r in rows if r["schedule"].startswith("r=")]
  panels = sorted({(r["model"], r["prompt_len"]) for r in fixed})
  if not panels:
    return {}
  with report.figure(path, len(panels)) as axes:
    for ax, (model, prompt_len) in zip(axes, panels):
      mine = [r for r in fixed if (r["model"], r["prompt_len"]) == (model, prompt_len)]
      for i, batch in enumerate(sorted({r["batch"] for r in mine})):
        line = sorted(
          (r for r in mine if r["batch"] == batch), key=lambda r: r["tokens_per_forward"]
        )
        xs = [r["tokens_per_forward"] for r in line]
        ax.plot(xs, [r["measured_speedup"] for r in line], "o-", color=f"C{i}", label=f"B={batch}")
        predicted = [r["predicted_speedup"] for r in line]
        ax.plot(xs, predicted, "x--", color=f"C{i}", alpha=0.6, label=f"B={batch} predicted")
      ax.axhline(1.0, color="gray", lw=0.8)
      ax.set_xscale("log", base=2)
      ax.set_title(f"{model} ({mine[0]['params'] / 1e6:.1f}M), prompt {prompt_len}")
      ax.set_xlabel("tokens revealed per forward")
      ax.set_ylabel("SBD / NTP tokens per second")
      ax.grid(alpha=0.3)
    axes[0].legend(title="solid measured, dashed predicted", fontsize=7, title_fontsize=7)
    return report.drawn(axes)


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
  flags.DEFINE_string("workdir", None, "A trained workdir: adds rows of it on held-out problems.")
  flags.DEFINE_string("task", "arithmetic", "With --workdir: the task its problems come from.")
  flags.DEFINE_string("data", None, "With --workdir and --task: the task's JSONL records.")
  flags.DEFINE_list("gammas", ["0.1", "0.35"], "γ of the EB rows (with --workdir).")
  flags.DEFINE_list(
    "wide_costs", [], "With --workdir: verified rows at these fixed `wide_cost` values (>= 1)."
  )
  flags.DEFINE_integer(
    "problems", 16, "With --workdir: problems per batch size, at least (whole batches)."
  )
  flags.DEFINE_integer(
    "cpus", 0, "Run on this many of the process's CPU cores (0: all); see `xla_cpu.use_cpus`."
  )
  xla_cpu.define_schedule_flag()
  flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    ints = {k: [int(x) for x in getattr(f, k)] for k in ("batches", "per_forward", "prompt_lens")}
    configs = {name: model_config(name, f.dtype) for name in f.models}
    if f.max_new_tokens is not None and f.max_new_tokens < 1:
      raise ValueError(f"--max_new_tokens={f.max_new_tokens}: a decode needs at least 1 token")
    wide_costs = [float(c) for c in f.wide_costs]
    if not all(c >= 1 for c in wide_costs):
      raise ValueError(f"--wide_costs values must be >= 1, got {f.wide_costs}")
    if any(r < 1 or r > BLOCK for r in ints["per_forward"]):
      raise ValueError(f"--per_forward values must be in [1, {BLOCK}]")
    cores = xla_cpu.use_cpus(f.cpus)
    xla_flags = xla_cpu.use_xla_cpu_options(f.concurrent_schedule)
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
      f.workdir, batches=ints["batches"], gammas=gammas, repeats=f.repeats, log=log, task=f.task,
      data=f.data, wide_costs=wide_costs, num_problems=f.problems,
    )  # fmt: skip
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
  report.save(f.out, "decode_speed", results, table, lambda path: plot(rows, path))
  print(table)
  log(f"wrote {f.out}/results.json, decode_speed.md, decode_speed.png")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
