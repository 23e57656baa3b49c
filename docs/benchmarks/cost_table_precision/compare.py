"""How precise a measured cost table is: `decode.costs.measure` at this checkout against the one
at COMMIT, alternating, REPEATS times each on one compiled decode program of a trained run
(its first BATCH held-out problems). Prints each table (each kind's cost in one-token forwards)
and, per kind, the range and the coefficient of variation over the repeats; writes them as JSON.

    python docs/benchmarks/cost_table_precision/compare.py WORKDIR BATCH REPEATS COMMIT OUT.json
"""

import importlib.util
import json
import subprocess
import sys
import time

import numpy as np

from sbd_jax.decode import costs, sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.evals import runner
from sbd_jax.evals.tasks import arithmetic
from sbd_jax.run import loading


def costs_at(commit: str):
  """`sbd_jax/decode/costs.py` as it was at `commit`, imported beside this checkout's."""
  source = subprocess.run(
    ["git", "show", f"{commit}:sbd_jax/decode/costs.py"], capture_output=True, text=True, check=True
  ).stdout
  path = f"/tmp/costs_{commit}.py"
  with open(path, "w") as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(f"costs_{commit}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def main(workdir: str, batch: int, repeats: int, commit: str, out: str) -> None:
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  problems = arithmetic.problems(config.data, batch, seed=0)
  budget = runner.reference_budget(problems, tokenizer, config.sample.block_size)
  s = settings_lib.from_config(config.sample, tokenizer, mask_id, budget=budget)
  s = s.replace(verify=True, wide_cost=0.0)
  prompts = [runner.prompt_ids(p, tokenizer, None) for p in problems]
  programs = []
  tuning = sampler._tuning

  def keep(sm, s, rows, key, call, mesh, table=None):
    programs.append(call)
    return tuning(sm, s, rows, key, call, mesh, table)

  sampler._tuning = keep
  sampler.decode(model, prompts, s, batch_size=batch)  # compiles the program and its kinds
  call = programs[0]

  def runner_for(module):
    def run(kind, limit):
      began = time.perf_counter()
      packed = np.asarray(call(module.forced(s, kind), np.int32(limit)))
      return time.perf_counter() - began, int(packed[0, -4])

    return run

  measures = {commit: costs_at(commit), "here": costs}
  tables = {name: [] for name in measures}
  seconds = {name: [] for name in measures}
  for _ in range(repeats):
    for name, module in measures.items():
      began = time.perf_counter()
      table = module.measure(runner_for(module), s, batch)
      seconds[name].append(time.perf_counter() - began)
      tables[name].append([float(c) for c in table.cost_K])
      print(name, f"{seconds[name][-1]:.1f} s", np.round(tables[name][-1], 2).tolist(), flush=True)
  result = {"workdir": workdir, "batch": batch, "kinds": list(costs.kind_names(s))}
  for name, rows in tables.items():
    a = np.asarray(rows)
    result[name] = {
      "tables": rows,
      "seconds": seconds[name],
      "min": a.min(0).tolist(),
      "max": a.max(0).tolist(),
      "cv": (a.std(0) / a.mean(0)).tolist(),
    }
    print(
      name,
      "cv",
      np.round(result[name]["cv"], 3).tolist(),
      "range",
      np.round(a.min(0), 2).tolist(),
      np.round(a.max(0), 2).tolist(),
    )
  with open(out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
