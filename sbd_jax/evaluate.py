"""CLI: accuracy and NFE speedup of NTP vs SBD decoding of a trained workdir, on a task.

    python -m sbd_jax.evaluate --workdir=DIR [--num_problems=512 --seed=S]      # built-in task
    python -m sbd_jax.evaluate --workdir=DIR --task=gsm8k --data=FILE.jsonl [--limit=N --out=DIR
        --chat=auto|yes|no]                 # records, summary and table in <workdir>/eval/<task>
    python -m sbd_jax.evaluate --task=humaneval --data=FILE.jsonl --score_completions=F.jsonl
    python -m sbd_jax.evaluate --workdir=DIR --diagnostics     # a weak model, or a bug?
    python -m sbd_jax.evaluate --workdir=DIR --diagnostics --task=exact --data=HELD_OUT.jsonl

Decode settings not given as flags are the run's (`sample` in its config.json). The library
calls: `evals.workdir_eval.evaluate_workdir`, `evals.scoring.score_completions`,
`evals.diagnostics.diagnose_workdir`.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from sbd_jax import cli, distributed

flags.DEFINE_string("workdir", None, "Training workdir with config.json and params/.")
flags.DEFINE_string("task", "arithmetic", "arithmetic | gsm8k | math500 | humaneval | mbpp | exact")
flags.DEFINE_string("data", None, "Benchmark JSONL file (plain or .gz) for --task != arithmetic.")
flags.DEFINE_integer("limit", None, "Evaluate only the first N problems of --data.")
flags.DEFINE_integer("num_problems", None, "Held-out arithmetic problems (default: the run's).")
flags.DEFINE_integer("seed", None, "Seed of the held-out arithmetic draw (default: the run's).")
flags.DEFINE_string(
  "out", None, "Records/summary directory (benchmark tasks: default <workdir>/eval/<task>)."
)
flags.DEFINE_enum("chat", "auto", ["auto", "yes", "no"], "Prompt with the chat template.")
flags.DEFINE_string(
  "score_completions", None, "Score this JSONL of task_id/completion records; no model."
)
flags.DEFINE_float("exec_timeout", 10.0, "Seconds each code test program may run.")
flags.DEFINE_list("gammas", None, "SBD γ values to sweep (default: the run's sample.gammas).")
flags.DEFINE_list(
  "rules",
  None,
  "Reveal rules: eb_entropy, eb_confidence, factor, threshold, confidence_threshold, fixed.",
)
flags.DEFINE_bool(
  "verify", None, "SBD also checked against NTP, beside plain (default: the run's sample.verify)."
)
cli.define_verification_flags()
cli.define_constraint_flags()
flags.DEFINE_bool("settle_eos", None, "Settle the positions past a revealed EOS together.")
flags.DEFINE_integer("block_size", None, "SBD block size (default: the run's).")
flags.DEFINE_integer("max_new_tokens", None, "Token budget; 0 = the task's (default: the run's).")
flags.DEFINE_integer("batch_size", None, "Decode batch size (default: the run's).")
flags.DEFINE_float("temperature", None, "0 = greedy (default: the run's).")
flags.DEFINE_bool("lockstep", None, "SBD batches wait at every block for their slowest row.")
flags.DEFINE_bool("refill", None, "A finished row takes the next problem at once.")
flags.DEFINE_integer("refill_rows", None, "With --refill: rows refilled together.")
flags.DEFINE_bool("json", False, "Print JSON instead of a table.")
flags.DEFINE_bool(
  "diagnostics",
  False,
  "Instead: SBD with block size 1 and γ = 0 next to NTP, MATP vs NTP loss by block offset, "
  "the tokens a wholly masked block misses, and the reveal order of a few answers (the "
  "built-in task, or --task with --data records that have a 'completion').",
)


def main(argv):
  del argv
  distributed.maybe_initialize()  # a model that spans hosts decodes on all of them
  f = flags.FLAGS
  from sbd_jax.evals import diagnostics, results, scoring, workdir_eval
  from sbd_jax.evals.tasks import execution

  limits = execution.Limits(timeout_s=f.exec_timeout, cpu_s=max(1, int(f.exec_timeout)))
  try:
    if f.score_completions:
      if not f.data:
        raise ValueError(f"--score_completions needs --data=<the {f.task} JSONL file>")
      out = scoring.score_completions(f.task, f.data, f.score_completions, limits)
      print(json.dumps(out, indent=2) if f.json else scoring.format_score(out))
      return
    if not f.workdir:
      raise ValueError("--workdir is required (or --score_completions to score without a model)")
    if f.diagnostics:
      d = diagnostics.diagnose_workdir(
        f.workdir,
        f.task,
        data=f.data,
        num_problems=(f.limit if f.data else f.num_problems) or 128,
        seed=f.seed,
      )
      print(json.dumps(d, indent=2) if f.json else diagnostics.format_diagnostics(d))
      return
    benchmark = f.task != "arithmetic"
    summary = workdir_eval.evaluate_workdir(
      f.workdir,
      f.task,
      data=f.data,
      limit=f.limit,
      num_problems=f.num_problems,
      seed=f.seed,
      rules=f.rules,
      gammas=None if f.gammas is None else [float(g) for g in f.gammas],
      batch_size=f.batch_size,
      out_dir=f.out or (os.path.join(f.workdir, "eval", f.task) if benchmark else None),
      chat_mode=f.chat,
      limits=limits,
      progress=benchmark,
      with_records=f.json and benchmark,
      block_size=f.block_size,
      max_new_tokens=f.max_new_tokens,
      temperature=f.temperature,
      verify=f.verify,
      settle_eos=f.settle_eos,
      **cli.verification_settings(),
      **cli.constraint_setting(),
      lockstep=f.lockstep,
      refill=f.refill,
      refill_rows=f.refill_rows,
    )
  except (FileNotFoundError, ValueError) as e:  # includes TaskDataError, ChatTemplateError
    cli.fail(e)
  if summary is None:  # not the lead process of a multi-host run
    return
  if f.json:
    print(json.dumps(summary, indent=2, ensure_ascii=False))
  else:
    print(results.format_table(summary))
    if summary["out_dir"]:
      print(f"records and summary in {summary['out_dir']}", file=sys.stderr)


if __name__ == "__main__":
  cli.run(main)
