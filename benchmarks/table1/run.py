"""The headline benchmark: the paper's Table 1 at small scale, with measured wall-clock.

    python -m benchmarks.table1 --out=DIR [--size=cpu|gpu|toy] [--ablation]
        [--peak_tflops=312 --bandwidth_gbs=2039] [--concurrent_schedule]

One run trains (or reuses, from DIR) an NTP baseline and an SBD model with the same data, steps
and seed on the arithmetic task and on a code corpus (the installed Python's stdlib sources,
`code_corpus`); `--ablation` adds a MATP-only model. It then measures exact-match accuracy and
NFE speedup (Table 1 rows, γ sweeps per reveal rule), NFE speedup and agreement on code
continuations, held-out NTP losses, decode wall-clock per token next to NFE speedup, the cached
forward time(n), and the roofline Tables 3/4. Outputs in DIR: results.json (every number),
table1.md, roofline.md, accuracy_vs_speedup.png, wallclock_vs_predicted.png, time_per_forward.png.

The pieces: `sizes` (what each size runs), `training` (configs, reuse of trained workdirs),
`measure` (accuracy, speedups, wall-clock, roofline), `tables` (the markdown), `plots`, and
`evals.heldout_rows` (held-out losses, packing); this module runs them in order. The wall-clock
is timed as `decode_speed` times it (`side_by_side.measure`), compiled with `xla_cpu`'s options
unless `--concurrent_schedule`.

`--size=cpu` trains the 0.84M-parameter `tiny` model on 2 CPU cores with configs/tiny.py's
recipe (`sizes.CPU_SBD`, `sizes.CPU_OPTIM`) for 1750 steps of 8 rows x 176 tokens, attention
chunks of 128: six trainings and the evaluation fit in about 25 minutes. `--size=toy` is the
test's (a few minutes incl. 4 tiny trainings); `--size=gpu` is a ~20M-parameter model trained
~10x longer, for an accelerator. A rerun with the same DIR skips the trainings whose config is
unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
from flax import nnx

from benchmarks.table1 import code_corpus, measure, plots, tables, training
from benchmarks.table1.sizes import (
  GAMMA_HIGH,
  GAMMA_LOW,
  PAPER_BENCHMARKS,
  PAPER_LLAMA,
  SIZES,
  Size,
)
from sbd_jax.data.pipeline import make_eval_problems
from sbd_jax.evals import heldout_rows, runner
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.run import loading


def _load_models(out_dir: str, task: str, modes) -> dict[str, tuple]:
  """mode -> (SamplingModel, tokenizer, mask_id) of the trained workdirs of `task`."""
  out = {}
  for mode in modes:
    model, _, tokenizer, mask_id = loading.load_sampling_model(
      os.path.join(out_dir, "runs", task, mode)
    )
    out[mode] = (model, tokenizer, mask_id)
  return out


def _heldout_losses(arith_models, code_models, arith_cfg, heldout_texts, size: Size) -> dict:
  """Plain NTP loss of every model on held-out problems and held-out code files."""
  problems = make_eval_problems(arith_cfg.data, size.loss_problems, seed=0)
  arith_rows = heldout_rows.pack_documents(
    [{"prompt": p.prompt, "completion": p.completion} for p in problems],
    arith_models["sbd"][1],
    size.seq_len,
  )
  code_rows = heldout_rows.pack_documents(
    [{"text": t} for t in heldout_texts], code_models["sbd"][1], size.code_seq_len,
    max_rows=size.loss_rows,
  )  # fmt: skip
  losses = {"arithmetic": {}, "code": {}}
  for mode in arith_models:
    losses["arithmetic"][mode] = heldout_rows.heldout_ntp_loss(arith_models[mode][0], arith_rows)
    losses["code"][mode] = heldout_rows.heldout_ntp_loss(code_models[mode][0], code_rows)
    training.log(
      f"held-out NTP loss, {mode} models: arithmetic "
      f"{losses['arithmetic'][mode]['loss']:.4f}, code {losses['code'][mode]['loss']:.4f}"
    )
  return losses


def run(
  out_dir: str,
  size: str | Size = "cpu",
  *,
  ablation: bool = False,
  peak_tflops: float = 312.0,
  bandwidth_gbs: float = 2039.0,
) -> dict[str, Any]:
  """Train (or reuse) every model under out_dir, evaluate, time, and write all outputs (its
  length is the results record, assembled field by field)."""
  size_name = size if isinstance(size, str) else "custom"
  if isinstance(size, str):
    if size not in SIZES:
      raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    size = SIZES[size]
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  modes = ("ntp", "sbd") + (("matp_only",) if ablation else ())
  corpus = code_corpus.build(os.path.join(out_dir, "code_corpus"), size.code_max_files)
  training.log(
    f"code corpus from {corpus.root}: {corpus.num_train} train files "
    f"({corpus.train_bytes / 1e6:.1f} MB), {corpus.num_heldout} held-out "
    f"({corpus.heldout_bytes / 1e6:.1f} MB)"
  )

  trained = {}
  for task in ("arithmetic", "code"):
    for mode in modes:
      c = training.train_config(size, mode, task, corpus.train_path)
      trained[f"{task}/{mode}"] = training.ensure_trained(
        c, os.path.join(out_dir, "runs", task, mode)
      )

  arith_models = _load_models(out_dir, "arithmetic", modes)
  code_models = _load_models(out_dir, "code", modes)
  arith_cfg = training.train_config(size, "sbd", "arithmetic")
  problems = arithmetic_task.problems(arith_cfg.data, size.num_problems, arith_cfg.train.seed)
  # The decode budget, resolved once for every arithmetic measurement (0 = the longest answer).
  if not size.max_new_tokens:
    budget = runner.reference_budget(problems, arith_models["sbd"][1], size.block_size)
    size = dataclasses.replace(size, max_new_tokens=budget)
  heldout_texts = code_corpus.read_texts(corpus.heldout_path)

  t_eval = time.perf_counter()
  losses = _heldout_losses(arith_models, code_models, arith_cfg, heldout_texts, size)
  arithmetic = measure.evaluate_arithmetic(arith_models, problems, size)
  code_tokenizer = code_models["sbd"][1]
  code = measure.evaluate_code(
    code_models, measure.code_prompts(heldout_texts, code_tokenizer, size), size
  )
  t_wall = time.perf_counter()
  wall = measure.measure_wallclock(*arith_models["sbd"], problems, size)
  roof, roof_md = measure.roofline_tables(peak_tflops, bandwidth_gbs)
  num_params = sum(
    x.size
    for x in jax.tree.leaves(
      nnx.state(nnx.merge(arith_models["sbd"][0].graphdef, arith_models["sbd"][0].state), nnx.Param)
    )
  )
  results = {
    "size": size_name,
    "config": dataclasses.asdict(size),
    "models": list(modes),
    "num_params": int(num_params),
    "corpus": dataclasses.asdict(corpus),
    "training": trained,
    "heldout_loss": losses,
    "arithmetic": arithmetic,
    "code": code,
    "wallclock": wall,
    "roofline": roof,
    "gamma_low": GAMMA_LOW,
    "gamma_high": GAMMA_HIGH,
    "paper_llama_3_1_8b": {
      k: {"model": m, "decoding": d, "cells": dict(zip(PAPER_BENCHMARKS, cells))}
      for k, (m, d, cells) in PAPER_LLAMA.items()
    },
    "seconds": {
      "training": sum(t["seconds"] for t in trained.values()),
      "evaluation": t_wall - t_eval,
      "wallclock": time.perf_counter() - t_wall,
      "total": time.perf_counter() - t_start,
    },
    "jax_version": jax.__version__,
    "backend": jax.default_backend(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, "table1.md"), "w") as f:
    f.write(tables.format_table1(results))
  with open(os.path.join(out_dir, "roofline.md"), "w") as f:
    f.write(roof_md)
  plots.write_all(results, out_dir)
  training.log(
    f"done in {results['seconds']['total']:.0f} s; wrote results.json, table1.md, roofline.md "
    f"and 3 plots to {out_dir}"
  )
  return results
