"""What a constrained program costs rows that hold no constraint: a server's pools are
constrained whenever structured output is on (the default), and most requests carry none.

    python -m benchmarks.unconstrained_rows --workdir=RUN --out=DIR [--batch=16 --rounds=7]

The run's first `--batch` held-out arithmetic problems are decoded by NTP, plain SBD and
verified SBD (every forward of one cost, `wide_cost=1`: the same forwards in both programs),
each by the unconstrained program and by a constrained one whose rows hold no constraint
(`sampler.decode(..., constraints=[None] * n)`). Both programs are timed in turns, after an
untimed call each; a row's time is its fastest call (load on a shared machine only adds time).
Outputs: DIR/results.json, DIR/unconstrained_rows.md.
"""

from __future__ import annotations

import time

from absl import flags

from benchmarks import report
from sbd_jax import cli

DECODINGS = {
  "ntp": dict(mode="ntp", verify=False),
  "sbd": dict(mode="sbd", verify=False),
  "sbd verified": dict(mode="sbd", verify=True),
}


def measure(workdir: str, batch: int, rounds: int) -> list[dict]:
  from sbd_jax.decode import sampler
  from sbd_jax.decode import settings as settings_lib
  from sbd_jax.evals import runner
  from sbd_jax.evals.tasks import arithmetic
  from sbd_jax.run.loading import load_sampling_model
  from sbd_jax.run.workdir import read_trained_config

  config = read_trained_config(workdir)
  problems = arithmetic.problems(config.data, batch, config.train.seed)
  model, _, tokenizer, mask_id = load_sampling_model(workdir)
  budget = runner.reference_budget(problems, tokenizer, config.sample.block_size)
  prompts = [tokenizer.encode_document(p.plain_prompt) for p in problems]
  run = settings_lib.from_config(config.sample, tokenizer, mask_id, max_new_tokens=budget)
  programs = {
    "unconstrained": {},
    "constrained, no constraint": dict(tokenizer=tokenizer, constraints=[None] * len(prompts)),
  }
  rows = []
  for name, changes in DECODINGS.items():
    s = run.replace(wide_cost=1.0, **changes)
    fastest, outputs = {}, {}
    for program, kw in programs.items():
      outputs[program] = sampler.decode(model, prompts, s, **kw)  # compiles
      fastest[program] = float("inf")
    for _ in range(rounds):
      for program, kw in programs.items():
        start = time.perf_counter()
        sampler.decode(model, prompts, s, **kw)
        fastest[program] = min(fastest[program], time.perf_counter() - start)
    free, constrained = outputs.values()
    if free.tokens != constrained.tokens:
      raise RuntimeError(f"{name}: the constrained program's text differs")
    rows.append(
      dict(
        decoding=name,
        batch=len(prompts),
        forwards=int(free.forwards),
        unconstrained_s=fastest["unconstrained"],
        constrained_s=fastest["constrained, no constraint"],
        ratio=fastest["constrained, no constraint"] / fastest["unconstrained"],
      )
    )
    print(markdown(rows[-1:]).splitlines()[-1], flush=True)
  return rows


def markdown(rows: list[dict]) -> str:
  header = ["decoding", "batch", "forwards", "unconstrained ms", "constrained ms", "ratio"]
  body = [
    [
      r["decoding"],
      str(r["batch"]),
      str(r["forwards"]),
      f"{r['unconstrained_s'] * 1e3:.1f}",
      f"{r['constrained_s'] * 1e3:.1f}",
      f"{r['ratio']:.2f}x",
    ]
    for r in rows
  ]
  return report.table(header, body)


def main(argv):
  del argv
  f = flags.FLAGS
  if f.batch < 1 or f.rounds < 1:
    cli.fail(ValueError("--batch and --rounds must be >= 1"))
  rows = measure(f.workdir, f.batch, f.rounds)
  table = markdown(rows)
  report.save(f.out, "unconstrained_rows", {"rows": rows}, table)
  print(table)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A trained run (the main job's).", required=True)
  flags.DEFINE_string("out", None, "results.json and unconstrained_rows.md go here.", required=True)
  flags.DEFINE_integer("batch", 16, "Held-out problems decoded together.")
  flags.DEFINE_integer("rounds", 7, "Timed calls of each program.")
  cli.run(main)
