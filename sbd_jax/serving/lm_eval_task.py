"""The built-in arithmetic task as an lm-evaluation-harness task, to score a served model.

    python -m sbd_jax.serving.lm_eval_task --workdir=DIR --out=TASK_DIR [--num_problems=512
        --seed=S]
    lm_eval --model local-completions --include_path TASK_DIR --tasks sbd_arithmetic \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=M,tokenizer_backend=none,tokenized_requests=False,num_concurrent=16

TASK_DIR gets the held-out problems `evaluate` draws for the same run and seed
(problems.jsonl), the task (sbd_arithmetic.yaml: generate_until over the plain prompts, with
`evaluate`'s decode budget) and its scorer (utils.py: this project's answer extraction). The
server's decoding is its default, or lm_eval's `--gen_kwargs decoding=ntp` / `gamma=0.1` (extra
request fields). Greedy decodes equal `evaluate`'s, so the accuracy is `evaluate`'s.
Loglikelihood tasks are refused by the server (`serving.protocol.NOT_SCORED`).
"""

from __future__ import annotations

import json
import os

from absl import flags

from sbd_jax import cli

TASK_NAME = "sbd_arithmetic"

_UTILS = '''"""Scores sbd_arithmetic generations as `python -m sbd_jax.evaluate` does."""

from sbd_jax.data.arithmetic import extract_answer


def process_results(doc, results):
  return {"acc": float(extract_answer(results[0]) == doc["answer"])}
'''


def task_yaml(data_file: str, max_new_tokens: int) -> str:
  return "\n".join(
    [
      f"task: {TASK_NAME}",
      "dataset_path: json",
      "dataset_kwargs:",
      "  data_files:",
      f"    test: {json.dumps(os.path.abspath(data_file))}",
      "test_split: test",
      "output_type: generate_until",
      'doc_to_text: "{{prompt}}"',
      'doc_to_target: "{{answer}}"',
      "generation_kwargs:",
      "  until: []",
      f"  max_gen_toks: {max_new_tokens}",
      "  do_sample: false",
      "  temperature: 0",
      "process_results: !function utils.process_results",
      "metric_list:",
      "  - metric: acc",
      "    aggregation: mean",
      "    higher_is_better: true",
      "",
    ]
  )


def write_task(workdir: str, out: str, num_problems: int = 0, seed: int | None = None) -> str:
  """Write the task for `workdir`'s run into `out`; returns the YAML's path."""
  from sbd_jax.data.tokenizer import load_tokenizer
  from sbd_jax.evals import runner
  from sbd_jax.evals.tasks import arithmetic
  from sbd_jax.run.workdir import read_trained_config

  config = read_trained_config(workdir)
  s = config.sample
  seed = config.train.seed if seed is None else seed
  problems = arithmetic.problems(config.data, num_problems or s.num_problems, seed)
  tokenizer = load_tokenizer(config.tokenizer, workdir)
  budget = s.max_new_tokens or runner.reference_budget(problems, tokenizer, s.block_size)
  os.makedirs(out, exist_ok=True)
  data_file = os.path.join(out, "problems.jsonl")
  with open(data_file, "w") as f:
    for p in problems:
      f.write(json.dumps({"task_id": p.task_id, "prompt": p.plain_prompt, **p.record}) + "\n")
  with open(os.path.join(out, "utils.py"), "w") as f:
    f.write(_UTILS)
  path = os.path.join(out, f"{TASK_NAME}.yaml")
  with open(path, "w") as f:
    f.write(task_yaml(data_file, budget))
  return path


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    path = write_task(f.workdir, f.out, f.num_problems, f.seed)
  except (FileNotFoundError, ValueError) as e:
    cli.fail(e)
  print(path)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "Training workdir.", required=True)
  flags.DEFINE_string("out", None, "Directory for the task files.", required=True)
  flags.DEFINE_integer("num_problems", 0, "Held-out problems; 0 = the run's sample.num_problems.")
  flags.DEFINE_integer("seed", None, "Problem seed; default: as evaluate (the run's train.seed).")
  cli.run(main)
