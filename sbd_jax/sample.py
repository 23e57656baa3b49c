"""CLI: decode prompts with SBD and with NTP from the same trained model; report NFE speedup.

    python -m sbd_jax.sample --workdir=DIR --prompt="Q: ..." [--prompts_file=F] [--rule=R
        --gamma=G --block_size=K --verify --draft=all|rule|none --max_new_tokens=N --temperature=T
        --seed=S --json --regex=R | --json_schema=FILE | --choices=A,B]

Decode settings not given as flags are the run's (`sample` in its config.json); the library
call is `run.compare.sample_workdir`.
"""

from __future__ import annotations

import json

from absl import flags

from sbd_jax import cli, distributed

flags.DEFINE_string("workdir", None, "Training workdir with config.json and params/.")
flags.DEFINE_string("prompt", None, "One prompt (a literal \\n becomes a newline).")
flags.DEFINE_string(
  "prompts_file", None, "A text file with one prompt per line (literal \\n becomes a newline)."
)
flags.DEFINE_string(
  "rule",
  None,
  "Reveal rule: eb_entropy, eb_confidence, factor, threshold, confidence_threshold, fixed.",
)
flags.DEFINE_float(
  "gamma", None, "The rule's γ (f, τ); 0 = one per forward (confidence_threshold: 1)."
)
flags.DEFINE_bool("verify", None, "SBD checked against NTP: NTP's text at SBD's forwards.")
cli.define_verification_flags()
cli.define_constraint_flags()
flags.DEFINE_bool("settle_eos", None, "Settle the positions past a revealed EOS together.")
flags.DEFINE_integer("block_size", None, "SBD block size.")
flags.DEFINE_integer("max_new_tokens", None, "Maximum generated tokens per prompt; 0 = default.")
flags.DEFINE_float("temperature", None, "0 = greedy; > 0 samples.")
flags.DEFINE_integer("seed", 0, "PRNG seed for temperature > 0.")
flags.DEFINE_integer("batch_size", None, "Prompts per decode batch (default: all).")
flags.DEFINE_bool("refill", None, "Through --batch_size rows, a finished row taking the next.")
flags.DEFINE_integer("refill_rows", None, "With --refill: rows refilled together.")
flags.DEFINE_bool("json", False, "Print JSON instead of text.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  distributed.maybe_initialize()  # a model that spans hosts decodes on all of them
  from sbd_jax.run import compare

  f = flags.FLAGS
  unescape = lambda text: text.replace("\\n", "\n")  # noqa: E731  (a literal \n -> newline)
  prompts = [unescape(f.prompt)] if f.prompt is not None else []
  try:
    if f.prompts_file:
      with open(f.prompts_file) as fh:
        prompts += [unescape(line.rstrip("\n")) for line in fh if line.strip()]
    results = compare.sample_workdir(
      f.workdir,
      prompts,
      seed=f.seed,
      batch_size=f.batch_size,
      rule=f.rule,
      gamma=f.gamma,
      block_size=f.block_size,
      max_new_tokens=f.max_new_tokens,
      temperature=f.temperature,
      verify=f.verify,
      settle_eos=f.settle_eos,
      **cli.verification_settings(),
      **cli.constraint_setting(),
      refill=f.refill,
      refill_rows=f.refill_rows,
    )
  except (FileNotFoundError, ValueError) as e:
    cli.fail(e)
  if distributed.is_lead_process():
    print(json.dumps(results, indent=2) if f.json else compare.format_results(results))


if __name__ == "__main__":
  cli.run(main)
