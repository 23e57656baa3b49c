"""Which of the README job's departures from the paper matter: configs/tiny.py trained once as it
is and once with each departure reverted alone (same seed, steps and data), then two more
training seeds for the two reversions that cost the most accuracy.

    python -m benchmarks.departures --out=DIR [--variants=a,b] [--extra_seeds=2]
        [--num_problems=512] [--jobs=1]

Every model decodes the same held-out problems (evaluation seed 0) with NTP and with SBD at
γ = 0.1 and 0.35. A run that stops is resumed by the same command: each variant and seed is a
workdir under DIR whose trainer resumes from its checkpoint, and a finished one is not trained
or evaluated again. `--jobs=N` trains and evaluates up to N of them at once in separate processes
(`benchmarks.processes`: on one GPU, all seven variants at once). Outputs: DIR/results.json,
DIR/departures.md, DIR/departures.png.
"""

from __future__ import annotations

import json
import os
import statistics

from absl import flags

import sbd_jax
from benchmarks import processes, report
from sbd_jax import cli
from sbd_jax import config as config_lib

_REPO = os.path.dirname(os.path.dirname(sbd_jax.__file__))
GAMMAS = (0.1, 0.35)

# name -> (what is reverted, config overrides). Decoding blocks of 16 need an EOS tail of 15
# tokens: rows of 192 (attention chunks of one half row) hold a problem with it.
VARIANTS = {
  "readme": ("none: configs/tiny.py", {}),
  "k_2_16": (
    "k ~ U{2..16}, decode blocks of 16",
    {
      "sbd.k_min": 2,
      "sbd.k_max": 16,
      "sample.block_size": 16,
      "train.seq_len": 192,
      "model.attention_chunk": 192,
    },
  ),  # fmt: skip
  "row_tiling": ("blocks tiled over the row", {"sbd.block_anchor": "row"}),
  "no_whole_blocks": ("no whole-masked blocks (per-token η only)", {"sbd.full_block_prob": 0.0}),
  "equal_weights": ("MATP weight 1", {"sbd.matp_weight": 1.0}),
  "no_ntp_phase": ("no NTP phase", {"sbd.ntp_fraction": 0.0}),
  "no_eos_tail": ("positions past EOS not trained", {"sbd.train_past_eos": False}),
}


def variant_config(name: str, seed: int):
  c = config_lib.from_file(os.path.join(_REPO, "configs", "tiny.py"))
  c.update_from_flattened_dict(VARIANTS[name][1])
  c.train.seed = seed
  c.train.progress_bar = False
  c.sample.gammas = GAMMAS
  return c


def run_one(out: str, name: str, seed: int, num_problems: int) -> dict:
  """Train (or resume) and evaluate one variant and seed; cached in its workdir."""
  from sbd_jax.evals import workdir_eval
  from sbd_jax.training import trainer

  workdir = os.path.join(out, f"{name}_seed{seed}")
  done = os.path.join(workdir, "departures_eval.json")
  if os.path.exists(done):
    with open(done) as f:
      return json.load(f)
  c = variant_config(name, seed)
  trainer.train(c, workdir)
  summary = workdir_eval.evaluate_workdir(
    workdir, num_problems=num_problems, seed=0, verify=False
  )  # what the recipe's model learned: plain SBD
  result = {"variant": name, "seed": seed, "block_size": summary["block_size"]}
  result.update(report.by_decoding(summary))
  with open(done, "w") as f:
    json.dump(result, f, indent=1)
  return result


def costliest(results: list[dict], count: int) -> list[str]:
  """The `count` reverted variants whose SBD at γ = 0.1 lost the most accuracy against the
  README job's (seed 0)."""
  base = next(r for r in results if r["variant"] == "readme" and r["seed"] == 0)
  loss = {
    r["variant"]: report.sbd_at(base, GAMMAS[0])["accuracy"]
    - report.sbd_at(r, GAMMAS[0])["accuracy"]
    for r in results
    if r["variant"] != "readme" and r["seed"] == 0
  }
  return sorted(loss, key=loss.get, reverse=True)[:count]


def format_markdown(results: list[dict]) -> str:
  header = ["reverted", "seeds", "NTP %"]
  header += [f"SBD γ={g} % (NFE speedup)" for g in GAMMAS]
  body = []
  for name, (what, _) in VARIANTS.items():
    runs = [r for r in results if r["variant"] == name]
    if not runs:
      continue
    mean = lambda xs: statistics.fmean(xs)  # noqa: E731
    cells = [what, ",".join(str(r["seed"]) for r in runs)]
    cells.append(f"{100 * mean([r['ntp']['accuracy'] for r in runs]):.1f}")
    for g in GAMMAS:
      acc = mean([report.sbd_at(r, g)["accuracy"] for r in runs])
      speed = mean([report.sbd_at(r, g)["nfe_speedup"] for r in runs])
      spread = ""
      if len(runs) > 1:
        accs = [100 * report.sbd_at(r, g)["accuracy"] for r in runs]
        spread = f" [{min(accs):.1f}-{max(accs):.1f}]"
      cells.append(f"{100 * acc:.1f}{spread} ({speed:.2f}x)")
    body.append(cells)
  return report.table(header, body)


def plot(results: list[dict], path: str):
  """One row per variant: SBD accuracy of every seed at both γ, the mean NFE speedup at γ = 0.1
  in the row's label (the variants' points would hide each other on a speedup axis)."""
  names = [n for n in VARIANTS if any(r["variant"] == n for r in results)]
  labels = []
  for name in names:
    runs = [r for r in results if r["variant"] == name]
    speed = statistics.fmean(report.sbd_at(r, GAMMAS[0])["nfe_speedup"] for r in runs)
    labels.append(f"{VARIANTS[name][0]}\n{speed:.2f}x fewer forwards at γ = {GAMMAS[0]}")
  with report.figure(path, 1, size=(8, 0.55 * len(names) + 1.6)) as (ax,):
    for gamma, marker in zip(GAMMAS, ("o", "x")):
      xs, ys = [], []
      for row, name in enumerate(names):
        runs = [r for r in results if r["variant"] == name]
        xs += [100 * report.sbd_at(r, gamma)["accuracy"] for r in runs]
        ys += [row] * len(runs)
      ax.plot(xs, ys, marker, linestyle="none", label=f"γ = {gamma}")
    ax.set_yticks(range(len(names)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("SBD exact match % (512 held-out problems), one point per training seed")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    return report.drawn([ax])


def main(argv):
  del argv
  f = flags.FLAGS
  names = f.variants.split(",") if f.variants else list(VARIANTS)
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    cli.fail(ValueError(f"unknown --variants {unknown}; known: {list(VARIANTS)}"))
  results = []
  first = [(f.out, name, 0, f.num_problems) for name in dict.fromkeys(["readme", *names])]
  for result in processes.starmap(run_one, first, f.jobs):
    results.append(result)
    print(format_markdown(results), flush=True)
  extra = [
    (f.out, name, seed, f.num_problems)
    for name in (costliest(results, 2) if f.extra_seeds else [])
    for seed in range(1, 1 + f.extra_seeds)
  ]
  results += processes.starmap(run_one, extra, f.jobs)
  table = format_markdown(results)
  print(table)
  report.save(f.out, "departures", {"results": results}, table, lambda p: plot(results, p))


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Workdirs and results go here.", required=True)
  flags.DEFINE_string("variants", "", "Comma-separated variants (default: all).")
  flags.DEFINE_integer("extra_seeds", 2, "More training seeds for the two costliest reversions.")
  flags.DEFINE_integer("num_problems", 512, "Held-out problems per evaluation.")
  flags.DEFINE_integer("jobs", 1, "Runs trained at once, in separate processes.", lower_bound=1)
  cli.run(main)
