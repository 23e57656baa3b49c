"""Structured output under lossless SBD: valid outputs, forwards and tokens per second of NTP and
verified SBD, unconstrained and constrained (with and without forced tokens), on a model
trained for the task, the same model untrained, and the main job's model; and what the
constraints cost to compile and hold.

    python -m benchmarks.structured --out=DIR [--main_job=/tmp/sbd_tiny --steps=800
        --num_problems=128 --batch_size=16 --repeats=3 --no128k]

A byte-vocabulary run of configs/paper_small.py's recipe (`jsonl_tasks.task_config`) trains on
`structured_task`'s records (DIR/train.jsonl) into DIR/run (skipped where its params exist).
Each model decodes the first `--num_problems` held-out prompts (DIR/held_out.jsonl), `--batch_size`
at a time, with every decoding of `DECODINGS`; an output is valid if it parses and validates
against `structured_task.SCHEMA` (the `jsonschema` package). The decodings are timed side by
side: every round times each once, after an untimed call (the median of `--repeats` rounds).
Then the schema and `json_object` are compiled over each model's vocabulary and a synthetic
128k one (`structured_task.synthetic_bpe`): compile time, automaton states, table bytes.
Outputs: DIR/results.json, DIR/structured.md, DIR/structured.png.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jsonschema
import numpy as np
from absl import flags
from flax import nnx

from benchmarks import jsonl_tasks, report
from benchmarks import structured_task as task
from sbd_jax import cli
from sbd_jax import config as config_lib
from sbd_jax.constrain.spec import Constraint
from sbd_jax.decode import automata, sampler
from sbd_jax.decode import settings as settings_lib
from sbd_jax.model.transformer import Transformer
from sbd_jax.run import loading

SCHEMA = Constraint.json_schema(task.SCHEMA)
# Verified decodes here count every forward at one cost (`wide_cost=1`: each forward the widest
# that settles most tokens), so their forwards do not depend on the machine's measured costs;
# what the clock makes of wide forwards is `benchmarks.decode_speed`'s question.
VERIFIED = dict(verify=True, wide_cost=1.0)
# name: (SamplerSettings overrides, constrained)
DECODINGS = {
  "ntp": (dict(mode="ntp"), False),
  "ntp, constrained": (dict(mode="ntp"), True),
  "verified": (VERIFIED, False),
  "verified, constrained": (VERIFIED, True),
  "verified, constrained, no forced tokens": (dict(VERIFIED, forced_tokens=False), True),
}


def valid(text: str) -> bool:
  try:
    jsonschema.validate(json.loads(text), task.SCHEMA)
  except (ValueError, jsonschema.ValidationError):
    return False
  return True


def write_data(out: str, num_train: int, num_problems: int) -> tuple[str, str]:
  paths = os.path.join(out, "train.jsonl"), os.path.join(out, "held_out.jsonl")
  for path, rows in zip(paths, (task.records(num_train, 0), task.records(num_problems, 1))):
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return paths


def train(out: str, steps: int) -> str:
  from sbd_jax.training import trainer

  os.makedirs(out, exist_ok=True)
  train_file, _ = write_data(out, 20_000, 512)
  workdir = os.path.join(out, "run")
  if not os.path.isdir(os.path.join(workdir, "params")):
    trainer.train(jsonl_tasks.task_config(train_file, steps), workdir)
  return workdir


def models(workdir: str, main_job: str | None):
  """{label: (SamplingModel, config, tokenizer, mask id)}: the trained model, the same config
  with its initial random weights, and the main job's model."""
  out = {"trained": loading.load_sampling_model(workdir)}
  _, config, tokenizer, mask_id = out["trained"]
  cfg = config_lib.to_model_config(config).for_decoding().replace(attention_impl="dense")
  untrained = nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))()
  out["untrained"] = (sampler.SamplingModel.of(untrained), config, tokenizer, mask_id)
  if main_job:
    out["main job"] = loading.load_sampling_model(main_job)
  return out


def decode_rows(label, loaded, records, batch, repeats, log) -> list[dict[str, Any]]:
  """Every decoding of `records`' prompts by one model: valid and exact shares, forwards per
  token, forced tokens, and tokens per second (side by side, `repeats` rounds)."""
  model, config, tokenizer, mask_id = loaded
  # Room for the longest answer the schema allows and its EOS (a word vocabulary may spell it
  # byte by byte): every constrained text ends complete.
  base = settings_lib.from_config(config.sample, tokenizer, mask_id, budget=task.LONGEST + 1)
  prompts = [list(tokenizer.encode_document(r["prompt"])) for r in records]
  settings = {
    name: base.replace(**over, constraint=SCHEMA if constrained else None)
    for name, (over, constrained) in DECODINGS.items()
  }

  def run(s):
    return sampler.decode(model, prompts, s, batch_size=batch, tokenizer=tokenizer)

  outs = {name: run(s) for name, s in settings.items()}  # compiles, and the first decode
  times = {name: [] for name in settings}
  for _ in range(repeats):
    for name, s in settings.items():
      run(s)  # warm: the call after another program's
      began = time.perf_counter()
      run(s)
      times[name].append(time.perf_counter() - began)
  rows = []
  for name, out in outs.items():
    texts = [tokenizer.decode([t for t in toks if t != base.eos_id]) for toks in out.tokens]
    tokens = sum(len(t) for t in out.tokens)
    complete = np.ones(len(texts), bool) if out.complete is None else np.asarray(out.complete)
    rows.append({
      "model": label,
      "decoding": name,
      "valid": float(np.mean([valid(t) for t in texts])),
      "exact": float(np.mean([t == r["completion"] for t, r in zip(texts, records)])),
      # the automaton accepts the text (always, unconstrained); none of these may be invalid
      "complete": float(np.mean(complete)),
      "complete_invalid": int(sum(c and not valid(t) for c, t in zip(complete, texts))),
      "tokens": tokens,
      "forwards": int(out.nfe.sum()),
      "forwards_per_token": float(out.nfe.sum()) / max(tokens, 1),
      "forced_tokens": 0 if out.forced_tokens is None else int(out.forced_tokens.sum()),
      "tokens_per_s": tokens / float(np.median(times[name])),
      "seconds": times[name],
      "examples": texts[:3],
    })  # fmt: skip
    log(f"{label} / {name}: {rows[-1]['valid']:.0%} valid, {rows[-1]['forwards_per_token']:.3f} "
        f"forwards a token, {rows[-1]['tokens_per_s']:.0f} tok/s")  # fmt: skip
  return rows


def compile_costs(vocabularies, log) -> list[dict[str, Any]]:
  """The schema and any JSON object compiled over each vocabulary: seconds (in the worker, the
  cache bypassed by a fresh compiler), states, table bytes."""
  from sbd_jax.constrain.compiler import ConstraintCompiler

  rows = []
  with ConstraintCompiler() as compiler:
    for label, vocab in vocabularies.items():
      for name, constraint in (("schema", SCHEMA), ("json_object", Constraint.json_object())):
        began = time.perf_counter()
        automaton = compiler.compile(constraint, vocab)
        rows.append({
          "vocabulary": label,
          "vocab_size": vocab.vocab_size,
          "constraint": name,
          "seconds": time.perf_counter() - began,
          "states": automaton.num_states,
          "moves": automaton.num_moves,
          "table_bytes": automaton.table_bytes,
        })  # fmt: skip
        log(f"{label} {name}: {rows[-1]['seconds']:.2f} s, {automaton.num_states} states, "
            f"{automaton.table_bytes / 2**20:.2f} MiB")  # fmt: skip
  return rows


def format_markdown(rows, costs) -> str:
  header = ["model", "decoding", "valid %", "complete %", "exact %", "forwards / token",
            "forced tokens", "tokens / s", "vs NTP tok/s"]  # fmt: skip
  ntp = {r["model"]: r["tokens_per_s"] for r in rows if r["decoding"] == "ntp"}
  body = [
    [r["model"], r["decoding"], f"{100 * r['valid']:.1f}", f"{100 * r['complete']:.1f}",
     f"{100 * r['exact']:.1f}",
     f"{r['forwards_per_token']:.3f}", str(r["forced_tokens"]), f"{r['tokens_per_s']:.0f}",
     f"{r['tokens_per_s'] / ntp[r['model']]:.2f}x"]
    for r in rows
  ]  # fmt: skip
  cost_header = ["vocabulary", "V", "constraint", "compile s", "states", "moves", "table MiB"]
  cost_body = [
    [c["vocabulary"], str(c["vocab_size"]), c["constraint"], f"{c['seconds']:.2f}",
     str(c["states"]), str(c["moves"]), f"{c['table_bytes'] / 2**20:.2f}"]
    for c in costs
  ]  # fmt: skip
  return report.table(header, body) + "\n\n" + report.table(cost_header, cost_body)


def plot(rows, path: str) -> report.Series:
  labels = list(DECODINGS)
  model_names = list(dict.fromkeys(r["model"] for r in rows))
  with report.figure(path, 2, size=(6, 4)) as (valid_ax, forwards_ax):
    for i, model in enumerate(model_names):
      mine = {r["decoding"]: r for r in rows if r["model"] == model}
      xs = [j + 0.25 * i for j in range(len(labels))]
      valid_ax.bar(xs, [100 * mine[d]["valid"] for d in labels], 0.25, label=model)
      forwards_ax.bar(xs, [mine[d]["forwards_per_token"] for d in labels], 0.25, label=model)
    for ax, name in ((valid_ax, "valid outputs %"), (forwards_ax, "forwards per token")):
      ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
      ax.set_title(name)
      ax.grid(alpha=0.3, axis="y")
    valid_ax.legend(fontsize=7)
    return report.drawn([valid_ax, forwards_ax])


def main(argv):
  del argv
  f = flags.FLAGS
  start = time.perf_counter()

  def log(message):
    print(f"[{time.perf_counter() - start:6.0f}s] {message}", file=sys.stderr, flush=True)

  workdir = train(f.out, f.steps)
  with open(os.path.join(f.out, "held_out.jsonl")) as fh:
    records = [json.loads(line) for line in fh][: f.num_problems]
  rows, vocabularies = [], {}
  for label, loaded in models(workdir, f.main_job).items():
    rows += decode_rows(label, loaded, records, f.batch_size, f.repeats, log)
    model, _, tokenizer, mask_id = loaded
    s = settings_lib.settings_for(tokenizer, mask_id)
    vocabularies.setdefault(
      type(tokenizer).__name__, automata.vocabulary(tokenizer, s, model.cfg.vocab_size)
    )
  if f.with128k:
    big = task.synthetic_bpe()
    s = settings_lib.settings_for(big, big.mask_id)
    vocabularies["synthetic BPE"] = automata.vocabulary(big, s, big.vocab_size)
  costs = compile_costs(vocabularies, log)
  results = {"rows": rows, "compile": costs, "seconds": time.perf_counter() - start}
  table = format_markdown(rows, costs)
  report.save(f.out, "structured", results, table, lambda p: plot(rows, p))
  print(table)


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Data, the run and results go here.", required=True)
  flags.DEFINE_string("main_job", None, "The main job's workdir, decoded too (optional).")
  flags.DEFINE_integer("steps", 800, "Training steps of the task's model (30 % NTP alone).")
  flags.DEFINE_integer("num_problems", 128, "Held-out prompts decoded.")
  flags.DEFINE_integer("batch_size", 16, "Rows per decode.")
  flags.DEFINE_integer("repeats", 3, "Timed rounds.")
  flags.DEFINE_bool("with128k", True, "Also compile over a synthetic 128k-token BPE.")
  cli.run(main)
