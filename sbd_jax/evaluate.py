"""Exact-match accuracy and NFE speedup of NTP vs SBD decoding on held-out arithmetic problems.

CLI: python -m sbd_jax.evaluate --workdir=DIR [--gammas=0,0.1,0.35,0.6 --rules=eb_entropy
--num_problems=64 --json]. `report_after_training` is what `sbd_jax.train` calls at the end.
NFE speedup = NTP forwards / SBD forwards per problem (each counted up to its EOS), averaged.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import flags

from sbd_jax import cli, reveal_rules, sampler, sharding
from sbd_jax.data import arithmetic
from sbd_jax.data.pipeline import make_eval_problems


def _scores(problems, out: sampler.DecodeOutput) -> np.ndarray:
  return np.asarray(
    [arithmetic.extract_answer(text) == p.answer for p, text in zip(problems, out.texts)], bool
  )


def evaluate_problems(
  model: sampler.SamplingModel,
  tokenizer,
  mask_id: int,
  problems: Sequence[arithmetic.Problem],
  *,
  rules: Sequence[str],
  gammas: Sequence[float],
  block_size: int,
  max_new_tokens: int,
  batch_size: int,
  mesh=None,
  temperature: float = 0.0,
  seed: int = 0,
) -> dict[str, Any]:
  """Decode `problems` with NTP once and with SBD per (rule, gamma); accuracy and speedups."""
  base = sampler.settings_for(
    tokenizer,
    mask_id,
    block_size=block_size,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
  )
  prompts = [p.prompt for p in problems]
  if mesh is not None:  # place the weights once; decode's own placement is then a no-op
    model = model.sharded(mesh)
  kwargs = dict(batch_size=batch_size, mesh=mesh, seed=seed)
  ntp = sampler.decode_text(model, tokenizer, prompts, base.replace(mode="ntp"), **kwargs)
  results: dict[str, Any] = {
    "num_problems": len(problems),
    "block_size": block_size,
    "max_new_tokens": max_new_tokens,
    "ntp": {"accuracy": float(_scores(problems, ntp).mean()), "mean_nfe": float(ntp.nfe.mean())},
    "sbd": [],
  }
  for rule in rules:
    for gamma in gammas:
      sbd = sampler.decode_text(
        model, tokenizer, prompts, base.replace(rule=rule, gamma=gamma), **kwargs
      )
      results["sbd"].append(
        {
          "rule": rule,
          "gamma": float(gamma),
          "accuracy": float(_scores(problems, sbd).mean()),
          "mean_nfe": float(sbd.nfe.mean()),
          "nfe_speedup": float(np.mean(ntp.nfe / np.maximum(sbd.nfe, 1))),
        }
      )
  return results


def format_table(results: dict[str, Any]) -> str:
  """A small fixed-width table: one row for NTP, one per SBD (rule, gamma)."""
  lines = [
    f"{results['num_problems']} held-out problems, block size {results['block_size']}, "
    f"max {results['max_new_tokens']} new tokens",
    f"{'decoding':<26} {'accuracy':>8} {'mean NFE':>9} {'NFE speedup':>12}",
  ]
  ntp = results["ntp"]
  lines.append(f"{'NTP':<26} {ntp['accuracy']:>8.3f} {ntp['mean_nfe']:>9.1f} {1.0:>11.2f}x")
  for row in results["sbd"]:
    name = f"SBD {row['rule']} γ={row['gamma']:g}"
    lines.append(
      f"{name:<26} {row['accuracy']:>8.3f} {row['mean_nfe']:>9.1f} {row['nfe_speedup']:>11.2f}x"
    )
  return "\n".join(lines)


def _mesh_or_none(config: ml_collections.ConfigDict):
  return sharding.make_mesh(config.mesh.shape) if jax.device_count() > 1 else None


def evaluate_workdir(
  workdir: str,
  *,
  rules: Sequence[str] = ("eb_entropy",),
  gammas: Sequence[float] = (0.0, 0.1, 0.35, 0.6),
  num_problems: int | None = None,
  block_size: int | None = None,
  max_new_tokens: int | None = None,
  batch_size: int | None = None,
  temperature: float = 0.0,
) -> dict[str, Any]:
  """Load <workdir>/params and evaluate on the run's held-out arithmetic problems."""
  for rule in rules:
    reveal_rules.get_rule(rule)
  if any(g < 0 for g in gammas):
    raise ValueError(f"gammas must be >= 0, got {list(gammas)}")
  config = sampler.read_workdir_config(workdir)
  mesh = _mesh_or_none(config)
  model, config, tokenizer, mask_id = sampler.load_sampling_model(workdir, mesh=mesh)
  problems = make_eval_problems(
    config.data, num_problems or config.sample.num_problems, seed=config.train.seed
  )
  return evaluate_problems(
    model,
    tokenizer,
    mask_id,
    problems,
    rules=rules,
    gammas=gammas,
    block_size=block_size or config.sample.block_size,
    max_new_tokens=max_new_tokens or config.sample.max_new_tokens,
    batch_size=batch_size or config.sample.batch_size,
    mesh=mesh,
    temperature=temperature,
  )


def report_after_training(workdir: str, config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Decode config.sample.num_problems problems with NTP and SBD at config.sample.gamma; print
  a table and return the numbers."""
  s = config.sample
  results = evaluate_workdir(
    workdir,
    rules=(s.rule,),
    gammas=(s.gamma,),
    num_problems=s.num_problems,
    block_size=s.block_size,
    max_new_tokens=s.max_new_tokens,
    batch_size=s.batch_size,
  )
  print(format_table(results), flush=True)
  return results


def _define_flags():
  flags.DEFINE_string("workdir", None, "Training workdir with config.json and params/.")
  flags.DEFINE_list("gammas", ["0", "0.1", "0.35", "0.6"], "SBD γ values to sweep.")
  flags.DEFINE_list("rules", ["eb_entropy"], "Reveal rules: eb_entropy, eb_confidence, factor.")
  flags.DEFINE_integer("num_problems", 64, "Held-out problems to decode.")
  flags.DEFINE_integer("block_size", None, "SBD block size (default: the run's config).")
  flags.DEFINE_integer("max_new_tokens", None, "Token limit (default: the run's config).")
  flags.DEFINE_integer("batch_size", None, "Decode batch size (default: the run's config).")
  flags.DEFINE_bool("json", False, "Print the results as JSON instead of a table.")
  flags.mark_flags_as_required(["workdir"])


def main(argv):
  """Thin CLI over `evaluate_workdir` (flags are defined only when run as a script)."""
  del argv
  f = flags.FLAGS
  try:
    results = evaluate_workdir(
      f.workdir,
      rules=f.rules,
      gammas=[float(g) for g in f.gammas],
      num_problems=f.num_problems,
      block_size=f.block_size,
      max_new_tokens=f.max_new_tokens,
      batch_size=f.batch_size,
    )
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")  # one line, exit status 1
  print(json.dumps(results, indent=2) if f.json else format_table(results))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
