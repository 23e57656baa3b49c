"""What bfloat16 does to "token for token": verified SBD against NTP's decode, NTP against
itself, in float32 and bfloat16, on trained models.

    python -m benchmarks.precision --out=DIR readme=/tmp/sbd_tiny \
        reverse=JSONL/reverse/run,exact,JSONL/reverse/held_out.jsonl [--num_problems=N
        --dtypes=float32,bfloat16]

Models are given as `benchmarks.rules` takes them (LABEL=WORKDIR[,TASK,DATA]). Per model and
compute dtype (the weights stored in it), the held-out problems are decoded (`DECODINGS`): NTP
and verified SBD as it decodes by default, each in the run's batch and one prompt at a time;
verified without pauses; and NTP at the verified decode's forward shapes (`draft` "none": each
forward the wide one, nothing drafted). Reported per pair of decodings: the prompts whose texts
differ; per decoding: accuracy, and verified against NTP the paired difference with its 95 %
interval. Outputs: DIR/results.json and DIR/precision.md.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from absl import flags

from benchmarks import report
from benchmarks.rules import parse_models
from sbd_jax import cli

# name: (SamplerSettings changes, one prompt at a time)
DECODINGS = {
  "ntp": (dict(mode="ntp", verify=False), False),
  "verified": (dict(mode="sbd", verify=True), False),
  "verified, no pauses": (dict(mode="sbd", verify=True, adaptive=False), False),
  "ntp at verified shapes": (dict(mode="sbd", verify=True, draft="none", adaptive=False), False),
  "ntp alone": (dict(mode="ntp", verify=False), True),
  "verified alone": (dict(mode="sbd", verify=True), True),
}
# The pairs whose texts are compared: (a, b, what a difference means).
PAIRS = (
  ("ntp", "ntp alone", "NTP, a batch against one prompt at a time"),
  ("verified", "ntp", "verified against NTP's decode, in a batch"),
  ("verified alone", "ntp alone", "verified against NTP's decode, one prompt at a time"),
  ("verified, no pauses", "ntp at verified shapes", "verified against NTP at its shapes"),
)


def differing(records: list[dict[str, Any]], a: str, b: str) -> list[str]:
  """Task ids whose completions differ between decodings `a` and `b`."""
  text = {(r["decoding"], r["task_id"]): r["completion"] for r in records}
  ids = [r["task_id"] for r in records if r["decoding"] == a]
  return [t for t in ids if text[(a, t)] != text[(b, t)]]


def measure_model(spec: dict[str, Any], dtype: str, num_problems: int | None) -> dict[str, Any]:
  """One model in one dtype: every decoding of `DECODINGS` scored, and `PAIRS` compared."""
  from sbd_jax.decode import settings as settings_lib
  from sbd_jax.evals import runner, stats, workdir_eval
  from sbd_jax.evals.tasks import arithmetic, registry
  from sbd_jax.run import loading

  task = registry.get(spec["task"])
  model, config, tokenizer, mask_id = loading.load_sampling_model(
    spec["workdir"], compute_dtype=dtype
  )
  s = config.sample
  if task is arithmetic.TASK:
    problems = arithmetic.problems(config.data, num_problems or s.num_problems, config.train.seed)
  else:
    problems = task.load(spec["data"], num_problems)
  budget = workdir_eval.task_budget(task, problems, tokenizer, s.block_size)
  base = settings_lib.from_config(s, tokenizer, mask_id, budget=budget)
  records = []
  for alone in (False, True):  # the runner decodes NTP first, named "ntp": alone, "ntp alone"
    decodings = [("ntp", base.replace(mode="ntp", verify=False))] + [
      (name, base.replace(**changes))
      for name, (changes, one) in DECODINGS.items()
      if one == alone and name not in ("ntp", "ntp alone")
    ]
    out = runner.evaluate(
      model, tokenizer, task, problems, decodings, batch_size=1 if alone else s.batch_size,
      template=None, with_records=True, progress=True,
    )  # fmt: skip
    for r in out["records"]:
      if alone and r["decoding"] == "ntp":
        r["decoding"] = "ntp alone"
    records += out["records"]
  correct = {name: {} for name in DECODINGS}
  for r in records:
    correct[r["decoding"]][r["task_id"]] = bool(r["correct"])
  ids = [p.task_id for p in problems]
  accuracy = {name: sum(c.values()) / len(ids) for name, c in correct.items()}
  verified, ntp = (np.asarray([correct[name][t] for t in ids]) for name in ("verified", "ntp"))
  return {
    "dtype": dtype,
    "num_problems": len(ids),
    "batch_size": s.batch_size,
    "differing": {f"{a} | {b}": differing(records, a, b) for a, b, _ in PAIRS},
    "accuracy": accuracy,
    "verified_minus_ntp": stats.paired_difference(verified, ntp),
  }


def markdown(results: dict[str, list[dict[str, Any]]]) -> str:
  """A row per (model, dtype): the prompts whose texts differ for each pair, then accuracy."""
  header = ["model", "dtype", *[what for _, _, what in PAIRS], "NTP %", "verified %", "vs NTP"]
  body = []
  for label, rows in results.items():
    for r in rows:
      n = r["num_problems"]
      cells = [f"{len(r['differing'][f'{a} | {b}'])} / {n}" for a, b, _ in PAIRS]
      d = r["verified_minus_ntp"]
      diff = f"{100 * d['mean']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]"
      acc = r["accuracy"]
      body.append(
        [label, r["dtype"], *cells, f"{100 * acc['ntp']:.1f}", f"{100 * acc['verified']:.1f}", diff]
      )
  return report.table(header, body)


def main(argv):
  f = flags.FLAGS
  try:
    models = parse_models(argv[1:])
    dtypes = f.dtypes.split(",")
    unknown = sorted(set(dtypes) - {"float32", "bfloat16"})
    if unknown:
      raise ValueError(f"unknown --dtypes {unknown}; choose float32, bfloat16")
  except ValueError as e:
    cli.fail(e)
  results = {}
  for label, spec in models.items():
    results[label] = [measure_model(spec, dtype, f.num_problems) for dtype in dtypes]
    print(markdown({label: results[label]}), flush=True)
  os.makedirs(f.out, exist_ok=True)
  table = markdown(results)
  report.save(f.out, "precision", {"models": results}, table)
  print(table)


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "results.json and precision.md go here.", required=True)
  flags.DEFINE_string("dtypes", "float32,bfloat16", "Compute dtypes, comma-separated.")
  flags.DEFINE_integer("num_problems", None, "Problems per model (default: the run's / all).")
  cli.run(main)
