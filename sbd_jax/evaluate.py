"""Exact-match accuracy and NFE speedup of NTP vs SBD decoding on held-out arithmetic problems,
and the entry point for benchmark files (GSM8K, MATH500, HumanEval, MBPP; `sbd_jax.tasks`).

CLI: python -m sbd_jax.evaluate --workdir=DIR [--gammas=0.1,0.35 --rules=eb_entropy
--num_problems=512 --seed=S --json]. `report_after_training` is what `sbd_jax.train` calls.
     python -m sbd_jax.evaluate --workdir=DIR --task=gsm8k --data=FILE.jsonl [--limit=N
--out=DIR --chat=auto|yes|no]: records, summary and table under <workdir>/eval/<task>/.
     python -m sbd_jax.evaluate --task=humaneval --data=FILE.jsonl --score_completions=F.jsonl:
scores completions made elsewhere (`task_id`, `completion`), no model.
NFE speedup = NTP forwards / SBD forwards per problem (each counted up to its EOS), averaged.
Every accuracy comes with a 95 % Wilson interval; every SBD row with its paired difference to
NTP on the same problems (mean and 95 % interval of the per-problem differences).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import flags

from sbd_jax import cli, distributed, sharding
from sbd_jax.data import arithmetic
from sbd_jax.data.pipeline import make_eval_problems
from sbd_jax.decode import sampler
from sbd_jax.sbd import reveal_rules
from sbd_jax.training import workdir as workdir_lib
from sbd_jax.training.dashboards import Dashboards

Z95 = 1.959964


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
  """95 % Wilson score interval of a binomial proportion (well-behaved near 0 and 1)."""
  if n == 0:
    return (0.0, 1.0)
  p = successes / n
  center = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return (max(0.0, center - half), min(1.0, center + half))


def paired_difference(a: np.ndarray, b: np.ndarray, z: float = Z95) -> dict[str, float]:
  """Mean of a - b over paired problems, with a normal-approximation 95 % interval."""
  d = a.astype(float) - b.astype(float)
  half = z * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else math.inf
  return {"mean": float(d.mean()), "ci95": (float(d.mean() - half), float(d.mean() + half))}


def score(problems: Sequence[arithmetic.Problem], texts: Sequence[str]) -> np.ndarray:
  """Per-problem exact match of the final answer."""
  return np.asarray(
    [arithmetic.extract_answer(text) == p.answer for p, text in zip(problems, texts)], bool
  )


def row_utilisation(nfe: np.ndarray, batch_forwards: np.ndarray) -> float:
  """Share of the decode loop's row-forwards that served a row still decoding: each row costs
  the forwards of its batch, which runs until its slowest row is done (under SBD in lockstep, it
  also waits at every block for the rows that have not completed it). 1.0 = no waste."""
  spent = int(np.sum(batch_forwards))
  return float(np.sum(nfe) / spent) if spent else 1.0


def summarize(correct: np.ndarray, out: sampler.DecodeOutput) -> dict[str, Any]:
  return {
    "accuracy": float(correct.mean()),
    "ci95": wilson_interval(int(correct.sum()), len(correct)),
    "mean_nfe": float(out.nfe.mean()),
    "row_utilisation": row_utilisation(out.nfe, out.batch_forwards),
  }


def evaluate_problems(
  model: sampler.SamplingModel,
  tokenizer,
  mask_id: int,
  problems: Sequence[arithmetic.Problem],
  *,
  rules: Sequence[str],
  gammas: Sequence[float],
  block_size: int,
  max_new_tokens: int,
  batch_size: int,
  mesh=None,
  temperature: float = 0.0,
  seed: int = 0,
  lockstep: bool = False,
  refill: bool = False,
  refill_rows: int = 1,
) -> dict[str, Any]:
  """Decode `problems` with NTP once and with SBD per (rule, gamma); accuracy and speedups.
  `lockstep`: whether SBD batches wait at every block for their slowest row. `refill`: whether
  a finished row takes the next problem at once (`sbd_jax.decode_queue`), `refill_rows` of
  them prefilled together."""
  base = sampler.settings_for(
    tokenizer,
    mask_id,
    block_size=block_size,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    lockstep=lockstep,
    refill=refill,
    refill_rows=refill_rows,
  )
  prompts = [p.prompt for p in problems]
  if mesh is not None:  # place the weights once; decode's own placement is then a no-op
    model = model.sharded(mesh)
  kwargs = dict(batch_size=batch_size, mesh=mesh, seed=seed)
  ntp = sampler.decode_text(model, tokenizer, prompts, base.replace(mode="ntp"), **kwargs)
  ntp_correct = score(problems, ntp.texts)
  results: dict[str, Any] = {
    "num_problems": len(problems),
    "block_size": block_size,
    "max_new_tokens": max_new_tokens,
    "ntp": summarize(ntp_correct, ntp),
    "sbd": [],
  }
  for rule in rules:
    for gamma in gammas:
      settings = base.replace(rule=rule, gamma=gamma)
      sbd = sampler.decode_text(model, tokenizer, prompts, settings, **kwargs)
      correct = score(problems, sbd.texts)
      results["sbd"].append(
        {
          "rule": rule,
          "gamma": float(gamma),
          **summarize(correct, sbd),
          "nfe_speedup": float(np.mean(ntp.nfe / np.maximum(sbd.nfe, 1))),
          "minus_ntp": paired_difference(correct, ntp_correct),
        }
      )
  return results


def _pct(x: float) -> str:
  return f"{100 * x:.1f}"


def format_table(results: dict[str, Any]) -> str:
  """Fixed-width table: one row for NTP, one per SBD (rule, gamma)."""
  seed = f" (seed {results['seed']})" if "seed" in results else ""
  lines = [
    f"{results['num_problems']} held-out problems{seed}, block size {results['block_size']}, "
    f"at most {results['max_new_tokens']} new tokens, greedy",
    f"{'decoding':<24} {'exact match %':>13} {'95% CI':>13} {'vs NTP (95% CI)':>21} "
    f"{'mean forwards':>14} {'NFE speedup':>12} {'rows busy %':>12}",
  ]

  def row(name: str, r: dict[str, Any], diff: str, speedup: float) -> str:
    ci = f"[{_pct(r['ci95'][0])}, {_pct(r['ci95'][1])}]"
    return (
      f"{name:<24} {_pct(r['accuracy']):>13} {ci:>13} {diff:>21} {r['mean_nfe']:>14.1f} "
      f"{speedup:>11.2f}x {_pct(r.get('row_utilisation', math.nan)):>12}"
    )

  lines.append(row("NTP", results["ntp"], "", 1.0))
  for r in results["sbd"]:
    d = r["minus_ntp"]
    diff = f"{100 * d['mean']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]"
    lines.append(row(f"SBD {r['rule']} γ={r['gamma']:g}", r, diff, r["nfe_speedup"]))
  return "\n".join(lines)


def mesh_or_none(config: ml_collections.ConfigDict):
  return sharding.mesh_from_config(config.mesh) if jax.device_count() > 1 else None


def token_limit(
  problems: Sequence[arithmetic.Problem], tokenizer, block_size: int, requested: int
) -> int:
  """The decode budget: `requested`, or when it is 0 the longest reference completion (with its
  EOS) rounded up to whole blocks. A budget shorter than a reference answer cuts answers,
  which then score as wrong: that gets a warning."""
  longest = max(len(tokenizer.encode(p.completion)) + 1 for p in problems)
  if requested == 0:
    return -(-longest // block_size) * block_size
  if requested < longest:
    print(
      f"warning: max_new_tokens={requested} is shorter than the longest reference answer "
      f"({longest} tokens with its EOS); cut answers score as wrong (0 = automatic)",
      file=sys.stderr,
    )
  return requested


def evaluate_workdir(
  workdir: str,
  *,
  rules: Sequence[str] = ("eb_entropy",),
  gammas: Sequence[float] = (0.1, 0.35),
  num_problems: int | None = None,
  seed: int | None = None,
  block_size: int | None = None,
  max_new_tokens: int | None = None,
  batch_size: int | None = None,
  temperature: float = 0.0,
  lockstep: bool = False,
  refill: bool = False,
  refill_rows: int = 1,
) -> dict[str, Any]:
  """Load <workdir>/params and evaluate on held-out arithmetic problems drawn with `seed`
  (default: the run's seed). Every seed's draw is disjoint from training (see arithmetic)."""
  for rule in rules:
    reveal_rules.get_rule(rule)
  if any(g < 0 for g in gammas):
    raise ValueError(f"gammas must be >= 0, got {list(gammas)}")
  if num_problems is not None and num_problems < 1:
    raise ValueError(f"num_problems must be >= 1, got {num_problems}")
  config = workdir_lib.read_trained_config(workdir)
  mesh = mesh_or_none(config)
  model, config, tokenizer, mask_id = workdir_lib.load_sampling_model(workdir, mesh=mesh)
  seed = config.train.seed if seed is None else seed
  problems = make_eval_problems(config.data, num_problems or config.sample.num_problems, seed)
  block_size = block_size or config.sample.block_size
  max_new_tokens = token_limit(
    problems, tokenizer, block_size, max_new_tokens or config.sample.get("max_new_tokens", 0)
  )
  results = evaluate_problems(
    model,
    tokenizer,
    mask_id,
    problems,
    rules=rules,
    gammas=gammas,
    block_size=block_size,
    max_new_tokens=max_new_tokens,
    batch_size=batch_size or config.sample.batch_size,
    mesh=mesh,
    temperature=temperature,
    lockstep=lockstep,
    refill=refill,
    refill_rows=refill_rows,
  )
  return {"seed": seed, **results}


def report_after_training(workdir: str, config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Decode config.sample.num_problems problems with NTP and with SBD at config.sample.gammas;
  print a table and return the numbers."""
  s = config.sample
  results = evaluate_workdir(
    workdir,
    rules=(s.rule,),
    gammas=tuple(s.gammas),
    num_problems=s.num_problems,
    block_size=s.block_size,
    max_new_tokens=s.max_new_tokens,
    batch_size=s.batch_size,
  )
  if distributed.is_lead_process():
    print(format_table(results), flush=True)
    dashboards = Dashboards(workdir, wandb_project=config.train.wandb_project)
    dashboards.scalars(config.train.steps, dashboard_scalars(results), prefix="eval")
    dashboards.close()
  return results


def dashboard_scalars(results: dict[str, Any]) -> dict[str, float]:
  """Accuracy per decoding and NFE speedup per SBD setting, named for TensorBoard / W&B."""
  scalars = {"ntp_accuracy": results["ntp"]["accuracy"]}
  for r in results["sbd"]:
    name = f"sbd_{r['rule']}_gamma{r['gamma']:g}"
    scalars[f"{name}_accuracy"] = r["accuracy"]
    scalars[f"{name}_nfe_speedup"] = r["nfe_speedup"]
  return scalars


def _define_flags():
  flags.DEFINE_string("workdir", None, "Training workdir with config.json and params/.")
  flags.DEFINE_string(
    "task",
    "arithmetic",
    "arithmetic (built-in, held-out draw) | gsm8k | math500 | humaneval | mbpp",
  )
  flags.DEFINE_string("data", None, "Benchmark JSONL file (plain or .gz) for --task != arithmetic.")
  flags.DEFINE_integer("limit", None, "Evaluate only the first N problems of --data.")
  flags.DEFINE_string("out", None, "Records/summary directory (default <workdir>/eval/<task>).")
  flags.DEFINE_enum("chat", "auto", ["auto", "yes", "no"], "Prompt with the chat template.")
  flags.DEFINE_string(
    "score_completions", None, "Score this JSONL of task_id/completion records; no model."
  )
  flags.DEFINE_float("exec_timeout", 10.0, "Seconds each code test program may run.")
  flags.DEFINE_list("gammas", ["0.1", "0.35"], "SBD γ values to sweep.")
  flags.DEFINE_list("rules", ["eb_entropy"], "Reveal rules: eb_entropy, eb_confidence, factor.")
  flags.DEFINE_integer("num_problems", None, "Held-out problems (default: the run's config).")
  flags.DEFINE_integer("seed", None, "Seed of the held-out draw (default: the run's seed).")
  flags.DEFINE_integer("block_size", None, "SBD block size (default: the run's config).")
  flags.DEFINE_integer("max_new_tokens", None, "Token limit (default: the run's config).")
  flags.DEFINE_integer("batch_size", None, "Decode batch size (default: the run's config).")
  flags.DEFINE_bool(
    "lockstep", False, "Whether SBD batches wait at every block for their slowest row."
  )
  flags.DEFINE_bool("refill", False, "Whether a finished row takes the next problem at once.")
  flags.DEFINE_integer(
    "refill_rows",
    1,
    "With --refill: rows refilled together (on a mesh, data x fsdp splits evenly).",
  )
  flags.DEFINE_bool("json", False, "Print the results as JSON instead of a table.")
  flags.DEFINE_bool(
    "diagnostics",
    False,
    "Instead: SBD with block size 1 and γ = 0 next to NTP, MATP vs NTP loss by block offset, "
    "and the reveal order of a few answers.",
  )


def _main_task(f) -> None:
  """--task other than arithmetic: a benchmark file, with a model or scoring given completions."""
  from sbd_jax.evals import runner  # pylint: disable=g-import-not-at-top
  from sbd_jax.evals.tasks import execution

  if not f.data:
    raise ValueError(f"--task={f.task} needs --data=<the benchmark's JSONL file>")
  limits = execution.Limits(timeout_s=f.exec_timeout, cpu_s=max(1, int(f.exec_timeout)))
  if f.score_completions:
    result = runner.score_completions(f.task, f.data, f.score_completions, limits)
    if f.json:
      print(json.dumps(result, indent=2))
    else:
      print(
        f"{f.task}: {100 * result['accuracy']:.1f} % correct (pass@1) over "
        f"{result['num_problems']} problems, {result['num_completions']} completions"
      )
    return
  if not f.workdir:
    raise ValueError("--workdir is required (or --score_completions to score without a model)")
  summary = runner.evaluate_task(
    f.workdir,
    f.task,
    f.data,
    out_dir=f.out,
    limit=f.limit,
    rules=f.rules,
    gammas=[float(g) for g in f.gammas],
    block_size=f.block_size,
    max_new_tokens=f.max_new_tokens,
    batch_size=f.batch_size,
    chat_mode=f.chat,
    limits=limits,
    with_records=f.json,
    refill=f.refill,
    refill_rows=f.refill_rows,
  )
  if summary is None:  # not the lead process of a multi-host run
    return
  if f.json:
    print(json.dumps(summary, indent=2, ensure_ascii=False))
  else:
    print(runner.format_table([summary]))
    print(f"records and summary in {summary['out_dir']}")


def main(argv):
  """Thin CLI over `evaluate_workdir` (flags are defined only when run as a script)."""
  del argv
  distributed.maybe_initialize()  # a model that spans hosts decodes on all of them
  f = flags.FLAGS
  try:
    if f.task != "arithmetic":
      return _main_task(f)
    if not f.workdir:
      raise ValueError("--workdir is required")
    if f.diagnostics:
      from sbd_jax.evals import diagnostics  # it builds on this module

      d = diagnostics.diagnose_workdir(f.workdir, num_problems=f.num_problems or 128, seed=f.seed)
      print(json.dumps(d, indent=2) if f.json else diagnostics.format_diagnostics(d))
      return
    results = evaluate_workdir(
      f.workdir,
      rules=f.rules,
      gammas=[float(g) for g in f.gammas],
      num_problems=f.num_problems,
      seed=f.seed,
      block_size=f.block_size,
      max_new_tokens=f.max_new_tokens,
      batch_size=f.batch_size,
      lockstep=f.lockstep,
      refill=f.refill,
      refill_rows=f.refill_rows,
    )
  except (FileNotFoundError, ValueError) as e:  # includes TaskDataError, ChatTemplateError
    sys.exit(f"error: {e}")  # one line, exit status 1
  if distributed.is_lead_process():
    print(json.dumps(results, indent=2) if f.json else format_table(results))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
