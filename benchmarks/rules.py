"""Every reveal rule side by side, plain and verified: accuracy against NFE speedup of trained
models, with one figure and one table of Pareto points per model.

    python -m benchmarks.rules --out=DIR readme=/tmp/sbd_tiny \
        reverse=JSONL/reverse/run,exact,JSONL/reverse/held_out.jsonl [--num_problems=N ...]

A model is LABEL=WORKDIR (the built-in task, the run's held-out draw) or
LABEL=WORKDIR,TASK,DATA (a task read from DATA, e.g. `exact` on a JSONL task's held-out
records). Each is decoded with NTP and, for every rule at each parameter of its grid (`GRIDS`),
plain and verified with drafts the rule picks (`SamplerSettings.draft` "rule"); then verified
as it decodes by default (every masked position drafted, the rule and γ do not enter, adapted to
each row's acceptance), and the same not adaptive (`SamplerSettings.adaptive` off); then
verified checked per block (`check_every_forward` off: a block's draft checked by the next
block's first forward) at each rule's most generous parameter and at EB-entropy γ = 0.35, the
comparison for checking at every forward; and plain EB-entropy with `settle_eos` off, which
shows what settling the positions past the answer saves and costs. Every other decode setting
is the run's (block size, budget, batch size).

Per model, in DIR/<label>/: the evaluation's records and summary (`evals.runner`, so an
interrupted run continues where it stopped), rules.png (accuracy against NFE speedup, a line
per rule, plain solid and verified dashed, NTP's accuracy dotted; and the verified decodings'
acceptance by position in the draft) and pareto.md (the decodings no other beats in both
accuracy and speedup). DIR/results.json holds every model's, and DIR/rules.md an overview
(`overview`) above their Pareto tables.
"""

from __future__ import annotations

import os
from typing import Any

from absl import flags

from benchmarks import report
from sbd_jax import cli

# Each rule's parameter, from "one token per forward" towards "many": γ of the EB and threshold
# rules, f of the factor rule, τ of the confidence threshold (falling).
GRIDS = {
  "eb_entropy": (0.01, 0.1, 0.35, 1.0, 3.0),
  "eb_confidence": (0.01, 0.1, 0.35, 1.0, 3.0),
  "threshold": (0.01, 0.05, 0.2, 0.5, 1.0),
  "confidence_threshold": (0.99, 0.9, 0.7, 0.5, 0.3),
  "factor": (0.25, 0.5, 1.0, 2.0, 4.0),
}
NO_SETTLE = ", settle_eos off"
PER_BLOCK = " checked per block"
DEFAULT_VERIFIED = "sbd verified"  # every masked position drafted, checked at every forward
NOT_ADAPTIVE = ", not adaptive"  # every forward the block's wide forward
# Every kind of forward at one cost (`wide_cost=1`): the choice an accelerator's memory-bound
# decode makes at small batches, whatever this machine measures.
AT_ONE_COST = ", every forward at one cost"


def parse_models(specs: list[str]) -> dict[str, dict[str, Any]]:
  """{label: {workdir, task, data}} from LABEL=WORKDIR[,TASK,DATA] arguments (one at least)."""
  if not specs:
    raise ValueError("give at least one LABEL=WORKDIR[,TASK,DATA]")
  models = {}
  for spec in specs:
    label, sep, rest = spec.partition("=")
    parts = rest.split(",")
    if not sep or not label or not parts[0] or len(parts) not in (1, 3):
      raise ValueError(f"argument {spec!r} is not LABEL=WORKDIR or LABEL=WORKDIR,TASK,DATA")
    if label in models:
      raise ValueError(f"model label {label!r} given twice")
    task, data = (parts[1], parts[2]) if len(parts) == 3 else ("arithmetic", None)
    models[label] = {"workdir": parts[0], "task": task, "data": data}
  return models


def decodings(base, rules: list[str]) -> list[tuple[str, Any]]:
  """NTP; every rule at every parameter of its grid, plain and verified (drafts the rule
  picks); verified drafting every masked position, as it decodes by default (each forward
  chosen by the costs it measures here), with every kind of forward at one cost, and not
  adaptive; verified checked per block at each rule's most generous parameter and at
  EB-entropy γ = 0.35; plain EB-entropy with settle_eos off. `rules` may be empty: NTP and
  the three verified decodings drafting every position."""
  base = base.replace(settle_eos=True, check_every_forward=True)
  out = [("ntp", base.replace(mode="ntp", verify=False))]
  for rule in rules:
    for gamma in GRIDS[rule]:
      for verify in (False, True):
        s = base.replace(mode="sbd", rule=rule, gamma=gamma, verify=verify, draft="rule")
        out.append((s.label, s))
  default = base.replace(mode="sbd", verify=True, draft="all", adaptive=True)
  out += [
    (DEFAULT_VERIFIED, default),
    (DEFAULT_VERIFIED + AT_ONE_COST, default.replace(wide_cost=1.0)),
    (DEFAULT_VERIFIED + NOT_ADAPTIVE, default.replace(adaptive=False)),
  ]
  per_block = [(rule, GRIDS[rule][-1]) for rule in rules]
  if "eb_entropy" in rules:
    per_block.append(("eb_entropy", 0.35))
  for rule, gamma in per_block:
    s = base.replace(mode="sbd", rule=rule, gamma=gamma, verify=True, draft="rule")
    out.append((s.replace(check_every_forward=False).label, s.replace(check_every_forward=False)))
  if "eb_entropy" in rules:
    for gamma in GRIDS["eb_entropy"]:
      s = base.replace(mode="sbd", rule="eb_entropy", gamma=gamma, verify=False, settle_eos=False)
      out.append((s.label + NO_SETTLE, s))
  return out


def evaluate_model(out_dir: str, spec: dict[str, Any], rules: list[str], **kwargs) -> dict:
  """The evaluation summary of one model over `decodings` (records in out_dir, resumed)."""
  from sbd_jax.decode import settings as settings_lib
  from sbd_jax.evals import runner, workdir_eval
  from sbd_jax.evals.tasks import arithmetic, registry
  from sbd_jax.run import loading
  from sbd_jax.run import workdir as workdir_lib

  task = registry.get(spec["task"])
  config = workdir_lib.read_trained_config(spec["workdir"])
  s = config.sample
  if task is arithmetic.TASK:
    seed = config.train.seed
    problems = arithmetic.problems(config.data, kwargs.get("num_problems") or s.num_problems, seed)
  else:
    seed = None
    problems = task.load(spec["data"], kwargs.get("num_problems"))
  mesh = loading.mesh_for(config)
  model, config, tokenizer, mask_id = loading.load_sampling_model(spec["workdir"], mesh=mesh)
  budget = workdir_eval.task_budget(task, problems, tokenizer, s.block_size)
  base = settings_lib.from_config(s, tokenizer, mask_id, budget=budget)
  return runner.evaluate(
    model,
    tokenizer,
    task,
    problems,
    decodings(base, rules),
    batch_size=kwargs.get("batch_size") or s.batch_size,
    mesh=mesh,
    seed=seed,
    template=None,
    out_dir=out_dir,
    source=spec["data"],
    progress=True,
  )


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The decodings that no other decoding beats in accuracy and NFE speedup at once (one
  better, the other at least equal, at the precision the tables print: 0.1 point, 0.01x), by
  speedup; of equal points, the first."""

  def point(r):
    return round(100 * r["accuracy"], 1), round(r["nfe_speedup"], 2)

  front, seen = [], set()
  for r in rows:
    a, x = point(r)
    beaten = any((oa >= a and ox >= x) and (oa, ox) != (a, x) for oa, ox in map(point, rows))
    if not beaten and (a, x) not in seen:
      front.append(r)
      seen.add((a, x))
  return sorted(front, key=lambda r: r["nfe_speedup"])


def _pct(x: float) -> str:
  return f"{100 * x:.1f}"


def pareto_table(label: str, summary: dict[str, Any]) -> str:
  """Markdown: the model's Pareto points, with NTP's accuracy in the heading."""
  rows = summary["decodings"]
  ntp = next(r for r in rows if r["decoding"] == "ntp")
  body = []
  for r in pareto(rows):
    d = r["minus_ntp"]
    body.append(
      [
        r["decoding"],
        _pct(r["accuracy"]),
        "" if d is None else f"{100 * d['mean']:+.1f}",
        f"{r['nfe_speedup']:.2f}x",
        f"{r.get('tokens_per_forward', 1.0):.2f}",
      ]
    )
  heading = (
    f"**{label}** ({summary['task']}, {summary['num_problems']} problems, block size "
    f"{summary['block_size']}; NTP {_pct(ntp['accuracy'])} %)"
  )
  header = ["Pareto point", "accuracy %", "vs NTP", "NFE speedup", "tokens/fwd"]
  return heading + "\n\n" + report.table(header, body)


def _cell(r: dict[str, Any] | None, named: bool = True) -> str:
  if r is None:
    return "none"
  point = f"{_pct(r['accuracy'])} % at {r['nfe_speedup']:.2f}x"
  return f"{r['decoding'][len('sbd ') :]}: {point}" if named else point


def _acceptance_cell(r: dict[str, Any] | None) -> str:
  a = (r or {}).get("acceptance")
  if a is None:
    return "none"
  return f"{100 * a['acceptance_rate']:.0f} %, {a['mean_acceptance_length']:.2f}"


def overview(results: dict[str, dict[str, Any]], within: float = 0.02) -> str:
  """Markdown, a row per model: NTP's accuracy; the fastest plain decoding within `within` of
  it; verified as it decodes by default, its acceptance rate and mean acceptance length; the
  fastest verified decoding drafted by a rule; the fastest checked per block."""
  body = []
  for label, r in results.items():
    rows = [x for x in r["summary"]["decodings"] if NO_SETTLE not in x["decoding"]]
    by_name = {x["decoding"]: x for x in rows}
    ntp = by_name["ntp"]
    plain = [
      x for x in rows if x["decoding"].startswith("sbd ") and "verified" not in x["decoding"]
    ]
    by_rule = [
      x for x in rows if x["decoding"].endswith(" verified") and rule_of(x["decoding"]) in GRIDS
    ]
    per_block = [x for x in rows if x["decoding"].endswith(PER_BLOCK)]
    close = [x for x in plain if x["accuracy"] >= ntp["accuracy"] - within]
    # The fastest (at the tables' precision), the most accurate of equally fast ones.
    key = lambda x: (round(x["nfe_speedup"], 2), x["accuracy"])  # noqa: E731
    fastest = lambda xs: max(xs, key=key) if xs else None  # noqa: E731
    default = by_name.get(DEFAULT_VERIFIED)
    body.append(
      [
        f"{label} ({r['summary']['task']}, k={r['summary']['block_size']})",
        _pct(ntp["accuracy"]),
        _cell(fastest(close)),
        _cell(default, named=False),
        _acceptance_cell(default),
        _cell(fastest(by_rule)),
        _cell(fastest(per_block)),
      ]
    )
  header = [
    "model",
    "NTP %",
    f"plain, fastest within {100 * within:g} points of NTP",
    "verified (default)",
    "accepted, mean acceptance length",
    "verified by a rule, fastest",
    "verified checked per block, fastest",
  ]
  return report.table(header, body)


def rule_of(name: str) -> str:
  return name.split()[1] if name.startswith("sbd ") else name


def plot(label: str, summary: dict[str, Any], path: str) -> report.Series:
  """Left, accuracy against NFE speedup: per rule a line through its grid, plain (solid,
  circles) and verified (dashed, squares); verified by default (a star) and checked per block
  (crosses); NTP's accuracy dashed grey; the Pareto front in grey. Right, the acceptance rate
  by position in the draft of the default verified decoding and of each rule's most generous
  verified one."""
  rows = summary["decodings"]
  with report.figure(path, 2, size=(6.0, 4.8)) as (ax, acc):
    for i, rule in enumerate(GRIDS):
      for verified, style in ((False, "o-"), (True, "s--")):
        picked = [
          r
          for r in rows
          if rule_of(r["decoding"]) == rule
          and r["decoding"].endswith(" verified") == verified
          and NO_SETTLE not in r["decoding"]
          and PER_BLOCK not in r["decoding"]
        ]
        if not picked:
          continue
        picked.sort(key=lambda r: r["nfe_speedup"])
        ax.plot(
          [r["nfe_speedup"] for r in picked],
          [100 * r["accuracy"] for r in picked],
          style,
          color=f"C{i}",
          fillstyle="none" if verified else "full",
          markersize=5,
          label=f"{rule}{' verified' if verified else ''}",
        )
    per_block = [r for r in rows if r["decoding"].endswith(PER_BLOCK)]
    if per_block:
      ax.plot(
        [r["nfe_speedup"] for r in per_block],
        [100 * r["accuracy"] for r in per_block],
        "x",
        color="black",
        label="verified, checked per block",
      )
    default = next((r for r in rows if r["decoding"] == DEFAULT_VERIFIED), None)
    if default is not None:
      ax.plot(
        [default["nfe_speedup"]], [100 * default["accuracy"]], "*", color="red", markersize=12,
        label=DEFAULT_VERIFIED,
      )  # fmt: skip
    front = pareto(rows)
    ax.plot(
      [r["nfe_speedup"] for r in front],
      [100 * r["accuracy"] for r in front],
      "-",
      color="grey",
      alpha=0.4,
      lw=4,
      label="Pareto front",
    )
    ntp = next(r for r in rows if r["decoding"] == "ntp")
    ax.axhline(100 * ntp["accuracy"], color="grey", ls=":", lw=1, label="NTP")
    ax.set_title(f"{label}: {summary['task']}, block size {summary['block_size']}")
    ax.set_xlabel("NFE speedup over NTP decoding (x)")
    ax.set_ylabel("accuracy %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    _plot_acceptance(acc, rows, label)
    return report.drawn([ax, acc])


def _plot_acceptance(ax, rows: list[dict[str, Any]], label: str) -> None:
  """Acceptance rate by position in the draft: the default verified decoding, and each rule's
  verified decoding at its most generous parameter."""
  generous = {f"sbd {rule} γ={grid[-1]:g} verified" for rule, grid in GRIDS.items()}
  for r in rows:
    a = r.get("acceptance")
    if a is None or r["decoding"] not in generous | {DEFAULT_VERIFIED}:
      continue
    by_position = a["acceptance_by_position"]
    main = r["decoding"] == DEFAULT_VERIFIED
    ax.plot(
      list(range(1, len(by_position) + 1)),
      [100 * x for x in by_position],
      "*-" if main else ".--",
      color="red" if main else f"C{list(GRIDS).index(rule_of(r['decoding']))}",
      lw=2 if main else 1,
      label=r["decoding"][len("sbd ") :],
    )
  ax.set_title(f"{label}: drafts accepted by position")
  ax.set_xlabel("position in the draft (1: the token after the verified one)")
  ax.set_ylabel("accepted % of drafts")
  ax.set_ylim(0, 100)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6)


def main(argv):
  f = flags.FLAGS
  try:
    models = parse_models(argv[1:])
    rules = [r for r in f.rules.split(",") if r]
    unknown = sorted(set(rules) - set(GRIDS))
    if unknown:
      raise ValueError(f"unknown --rules {unknown}; known: {list(GRIDS)}")
  except ValueError as e:
    cli.fail(e)
  results, tables = {}, []
  for label, spec in models.items():
    folder = os.path.join(f.out, label)
    summary = evaluate_model(
      folder, spec, rules, num_problems=f.num_problems, batch_size=f.batch_size
    )
    results[label] = {**spec, "summary": summary, "pareto": pareto(summary["decodings"])}
    tables.append(pareto_table(label, summary))
    with open(os.path.join(folder, "pareto.md"), "w") as out:
      out.write(tables[-1] + "\n")
    plot(label, summary, os.path.join(folder, "rules.png"))
    print(tables[-1], flush=True)
  table = overview(results) + "\n\n" + "\n\n".join(tables)
  report.save(f.out, "rules", {"models": results}, table)
  print(overview(results))


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Records, summaries, tables and figures go here.", required=True)
  flags.DEFINE_string("rules", ",".join(GRIDS), "Comma-separated rules.")
  flags.DEFINE_integer("num_problems", None, "Problems per model (default: the run's / all).")
  flags.DEFINE_integer("batch_size", None, "Decode rows (default: the run's sample.batch_size).")
  cli.run(main)
