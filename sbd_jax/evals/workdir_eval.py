"""Evaluate a trained workdir on a task: what `python -m sbd_jax.evaluate` and the end of the
main job run.

Problems: the built-in task draws `num_problems` held-out problems for `seed` (default: the
run's seed; every seed's draw is disjoint from training); a benchmark task reads `data`. The
decodings are NTP and SBD for every (rule, γ); every other decode setting is the run's
`sample` group unless overridden (`decode.settings.from_config`). The budget, when the run sets
none, is the task's own (the built-in task: its longest reference answer).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import ml_collections

from sbd_jax import distributed
from sbd_jax.decode import settings as settings_lib
from sbd_jax.evals import results, runner
from sbd_jax.evals.tasks import arithmetic, execution, registry
from sbd_jax.run import workdir as workdir_lib
from sbd_jax.run.loading import load_sampling_model, mesh_for
from sbd_jax.training.dashboards import Dashboards


def evaluate_workdir(
  workdir: str,
  task_name: str = "arithmetic",
  *,
  data: str | None = None,
  limit: int | None = None,
  num_problems: int | None = None,
  seed: int | None = None,
  rules: Sequence[str] | None = None,
  gammas: Sequence[float] | None = None,
  batch_size: int | None = None,
  out_dir: str | None = None,
  chat_mode: str = "auto",
  limits: execution.Limits = execution.DEFAULT_LIMITS,
  progress: bool = False,
  with_records: bool = False,
  **overrides: Any,
) -> dict[str, Any] | None:
  """The summary (`runner.evaluate`) of <workdir>/params on a task; None on processes other
  than the lead. `rules` / `gammas` default to the run's `sample.rule` / `sample.gammas`;
  `overrides` are `SamplerSettings` fields (None: the run's)."""
  task = registry.get(task_name)
  if num_problems is not None and num_problems < 1:
    raise ValueError(f"num_problems must be >= 1, got {num_problems}")
  if task is arithmetic.TASK and data:
    raise ValueError("the arithmetic task draws its problems: give --num_problems and --seed")
  if task is not arithmetic.TASK:
    if not data:
      raise ValueError(f"--task={task_name} needs --data=<the benchmark's JSONL file>")
    problems = task.load(data, limit)
  config = workdir_lib.read_trained_config(workdir)
  s = config.sample
  rules = (s.rule,) if rules is None else tuple(rules)
  gammas = tuple(s.gammas) if gammas is None else tuple(gammas)
  runner.check_sweep(rules, gammas)
  settings_lib.check_block_size(config, overrides.get("block_size"))
  if task is arithmetic.TASK:
    seed = config.train.seed if seed is None else seed
    problems = arithmetic.problems(config.data, num_problems or s.num_problems, seed)
  mesh = mesh_for(config)
  model, config, tokenizer, mask_id = load_sampling_model(workdir, mesh=mesh)
  template = runner.resolve_template(tokenizer, chat_mode)
  block_size = s.block_size if overrides.get("block_size") is None else overrides["block_size"]
  base = settings_lib.from_config(
    s,
    tokenizer,
    mask_id,
    budget=task_budget(task, problems, tokenizer, block_size),
    **overrides,
  )
  warn_if_answers_are_cut(task, problems, tokenizer, base.max_new_tokens)
  return runner.evaluate(
    model,
    tokenizer,
    task,
    problems,
    runner.standard_decodings(base, rules, gammas),
    batch_size=batch_size or s.batch_size,
    mesh=mesh,
    seed=seed if task is arithmetic.TASK else None,
    template=template,
    limits=limits,
    out_dir=out_dir,
    source=data,
    progress=progress,
    with_records=with_records,
  )


def task_budget(task, problems, tokenizer, block_size: int) -> int:
  """The task's own decode budget (0 = the longest reference answer, whole blocks)."""
  if task.max_new_tokens or block_size < 1:  # a bad block size is refused by the settings
    return task.max_new_tokens
  return runner.reference_budget(problems, tokenizer, block_size)


def warn_if_answers_are_cut(task, problems, tokenizer, max_new_tokens: int) -> None:
  """A budget shorter than a reference answer cuts answers, which then score as wrong."""
  if task.max_new_tokens:
    return
  longest = max(len(tokenizer.encode(p.record["completion"])) + 1 for p in problems)
  if max_new_tokens < longest:
    print(
      f"warning: max_new_tokens={max_new_tokens} is shorter than the longest reference answer "
      f"({longest} tokens with its EOS); cut answers score as wrong (0 = automatic)",
      file=sys.stderr,
    )


def report_after_training(workdir: str, config: ml_collections.ConfigDict) -> dict | None:
  """The end of the main job: `config.sample.num_problems` held-out problems decoded with NTP
  and with SBD at `config.sample.gammas`; the lead process prints the table and writes the
  numbers to the dashboards."""
  summary = evaluate_workdir(workdir, num_problems=config.sample.num_problems)
  if distributed.is_lead_process():
    print(results.format_table(summary), flush=True)
    dashboards = Dashboards(workdir, wandb_project=config.train.wandb_project)
    dashboards.scalars(config.train.steps, results.dashboard_scalars(summary), prefix="eval")
    dashboards.close()
  return summary
