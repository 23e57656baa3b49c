"""The paper's recipe on tasks given as JSONL, whose answer the prompt fully determines: a copy,
a reversal and a letter mapping, each trained and decoded with configs/paper_small.py's recipe
(k ~ U{2..16}, decode blocks of 16, per-token η, equal weights, row tiling, EOS tail).

    python -m benchmarks.jsonl_tasks --out=DIR [--tasks=copy,reverse,shift --steps=800
        --batch_size=8 --num_workers=0 --num_train=20000 --num_problems=512 --jobs=1]

Per task: DIR/<task>/train.jsonl and held_out.jsonl ({"prompt", "completion"} records of random
lowercase words, 4-24 letters; held-out words are drawn with another seed), a byte-vocabulary
run of configs/paper_small.py on train.jsonl (its first 30 % NTP alone), then
`evaluate --task=exact` on the held-out records: NTP and SBD at γ = 0.1 and 0.35, and
`evaluate --diagnostics` on the first 128 of them (DIR/<task>/diagnostics.txt and .json: where
SBD loses to NTP). A finished task is not run again; `--jobs=N` runs up to N tasks at once in
separate processes (`benchmarks.processes`). Outputs: DIR/results.json, DIR/jsonl_tasks.md,
DIR/jsonl_tasks.png.
"""

from __future__ import annotations

import json
import os
import random
import string

from absl import flags

import sbd_jax
from benchmarks import processes, report
from sbd_jax import cli
from sbd_jax import config as config_lib

_REPO = os.path.dirname(os.path.dirname(sbd_jax.__file__))
GAMMAS = (0.1, 0.35)
_SHIFT = str.maketrans(string.ascii_lowercase, string.ascii_lowercase[1:] + "a")
TASKS = {
  "copy": lambda w: w,
  "reverse": lambda w: w[::-1],
  "shift": lambda w: w.translate(_SHIFT),  # each letter to the next one, z to a
}


def records(task: str, n: int, seed: int) -> list[dict[str, str]]:
  rng = random.Random(f"{task}/{seed}")
  out = []
  for _ in range(n):
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 24)))
    out.append({"prompt": f"{task} {word} =", "completion": f" {TASKS[task](word)}"})
  return out


def _write(path: str, rows: list[dict]) -> None:
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def task_config(train_file: str, steps: int, batch_size: int | None = None, num_workers: int = 0):
  c = config_lib.from_file(os.path.join(_REPO, "configs", "paper_small.py"))
  c.tokenizer = "byte"
  c.data.source = "jsonl"
  c.data.paths = train_file
  c.train.steps = steps
  c.train.batch_size = batch_size or c.train.batch_size
  c.data.num_workers = num_workers
  c.optim.warmup_steps = min(c.optim.warmup_steps, steps // 10)
  c.checkpoint.every_steps = steps
  c.sample.num_problems = 0  # no built-in task at the end: the held-out JSONL is evaluated here
  c.sample.gammas = GAMMAS
  c.train.progress_bar = False
  return c


def run_task(
  out: str,
  task: str,
  steps: int,
  num_train: int,
  num_problems: int,
  batch_size: int | None = None,
  num_workers: int = 0,
) -> dict:
  from sbd_jax.evals import diagnostics, workdir_eval
  from sbd_jax.training import trainer

  folder = os.path.join(out, task)
  done = os.path.join(folder, "result.json")
  if os.path.exists(done):
    with open(done) as f:
      return json.load(f)
  os.makedirs(folder, exist_ok=True)
  train_file, held_out = os.path.join(folder, "train.jsonl"), os.path.join(folder, "held_out.jsonl")
  _write(train_file, records(task, num_train, seed=0))
  _write(held_out, records(task, num_problems, seed=1))
  workdir = os.path.join(folder, "run")
  config = task_config(train_file, steps, batch_size, num_workers)
  trainer.train(config, workdir)
  summary = workdir_eval.evaluate_workdir(
    workdir, "exact", data=held_out, chat_mode="no", verify=False
  )  # what the recipe's model learned: plain SBD
  d = diagnostics.diagnose_workdir(workdir, "exact", data=held_out, num_problems=128)
  with open(os.path.join(folder, "diagnostics.txt"), "w") as f:
    f.write(diagnostics.format_diagnostics(d) + "\n")
  with open(os.path.join(folder, "diagnostics.json"), "w") as f:
    json.dump(d, f, indent=1, ensure_ascii=False)
  result = {"task": task, "steps": steps, "batch_size": config.train.batch_size}
  result["block_size"] = summary["block_size"]
  result.update(report.by_decoding(summary))
  with open(done, "w") as f:
    json.dump(result, f, indent=1)
  return result


def format_markdown(results: list[dict]) -> str:
  header = ["task", "NTP %"] + [f"SBD γ={g} % (NFE speedup)" for g in GAMMAS]
  body = []
  for r in results:
    cells = [r["task"], f"{100 * r['ntp']['accuracy']:.1f}"]
    for g in GAMMAS:
      s = report.sbd_at(r, g)
      cells.append(f"{100 * s['accuracy']:.1f} ({s['nfe_speedup']:.2f}x)")
    body.append(cells)
  return report.table(header, body)


def plot(results: list[dict], path: str):
  with report.figure(path, 1, size=(5.5, 4)) as (ax,):
    styles = ("-o", "--s", ":^", "-.D")  # tasks often coincide: each must stay visible
    for i, r in enumerate(results):
      xs = [1.0] + [report.sbd_at(r, g)["nfe_speedup"] for g in GAMMAS]
      ys = [100 * r["ntp"]["accuracy"]] + [100 * report.sbd_at(r, g)["accuracy"] for g in GAMMAS]
      ax.plot(xs, ys, styles[i % len(styles)], label=r["task"], fillstyle="none", markersize=8)
    ax.set_xlabel("NFE speedup over NTP (NTP, then γ = 0.1, 0.35)")
    ax.set_ylabel("exact match % (held-out records)")
    ax.legend(fontsize=8)
    return report.drawn([ax])


def main(argv):
  del argv
  f = flags.FLAGS
  names = f.tasks.split(",")
  unknown = sorted(set(names) - set(TASKS))
  if unknown:
    cli.fail(ValueError(f"unknown --tasks {unknown}; known: {list(TASKS)}"))
  results = []
  calls = [
    (f.out, name, f.steps, f.num_train, f.num_problems, f.batch_size, f.num_workers)
    for name in names
  ]
  for result in processes.starmap(run_task, calls, f.jobs):
    results.append(result)
    print(format_markdown(results), flush=True)
  table = format_markdown(results)
  report.save(f.out, "jsonl_tasks", {"results": results}, table, lambda p: plot(results, p))


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Task data, workdirs and results go here.", required=True)
  flags.DEFINE_string("tasks", ",".join(TASKS), "Comma-separated tasks.")
  flags.DEFINE_integer("steps", 800, "Training steps per task (30 % of them NTP alone).")
  flags.DEFINE_integer("batch_size", None, "Rows per training step (default: the config's 8).")
  flags.DEFINE_integer("num_workers", 0, "Data worker processes (0: in the trainer's process).")
  flags.DEFINE_integer("num_train", 20_000, "Training records per task.")
  flags.DEFINE_integer("num_problems", 512, "Held-out records per task.")
  flags.DEFINE_integer("jobs", 1, "Tasks run at once, in separate processes.", lower_bound=1)
  cli.run(main)
