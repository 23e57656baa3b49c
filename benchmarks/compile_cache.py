"""What the persistent compilation cache saves a restart: each program launched twice in fresh
processes on one cache directory, the first launch compiling, the second loading.

    python -m benchmarks.compile_cache --out=DIR [--config=configs/tiny.py]
        [--aot_config=configs/llama8b.py --topology=v5p-128]   # --topology= to skip the AOT rows
        [--aot_override=model.attention_impl=chunked ...]

Programs: the config's train steps (NTP and SBD phases; the trainer logs each phase's first step,
compile or cache load included), a `sample` of the trained run (the whole command's wall time:
loading, the SBD and NTP decode compiles, the decode), and with `--topology` the 8B train step
compiled ahead of time for a TPU slice (`sbd_jax.aot`'s compile time: JAX writes it to the cache
but cannot load it for a described slice, so this row measures that the cache does not serve
AOT compiles). Outputs:
DIR/results.json, DIR/compile_cache.md; the cache itself in DIR/cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from absl import flags

import sbd_jax
from benchmarks import report
from sbd_jax import cli

_REPO = os.path.dirname(os.path.dirname(sbd_jax.__file__))
_FIRST_STEP = re.compile(r"first (\w+) step \(compile or cache load, then the step\): ([\d.]+) s")


def _run(args: list[str]) -> tuple[str, float]:
  """(stdout, then stderr; wall seconds) of `python -m <args>`, which must succeed."""
  start = time.perf_counter()
  done = subprocess.run(
    [sys.executable, "-m", *args], capture_output=True, text=True, cwd=_REPO, check=False
  )
  seconds = time.perf_counter() - start
  if done.returncode:
    raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
  return done.stdout + done.stderr, seconds


def train_launch(config: str, workdir: str, cache: str, steps: int) -> dict[str, float]:
  overrides = [f"--config.train.steps={steps}", f"--config.compile_cache={cache}"]
  overrides += ["--config.train.progress_bar=false", "--evaluate=false"]
  log, seconds = _run(["sbd_jax.train", f"--config={config}", f"--workdir={workdir}", *overrides])
  firsts = {f"first {name} step": float(s) for name, s in _FIRST_STEP.findall(log)}
  return {**firsts, "train command": seconds}


def sample_launch(workdir: str) -> dict[str, float]:
  _, seconds = _run(["sbd_jax.sample", f"--workdir={workdir}", "--prompt=Q: 1", "--json"])
  return {"sample command": seconds}


def aot_launch(config: str, topology: str, cache: str, overrides: list[str]) -> dict[str, float]:
  log, _ = _run(["sbd_jax.aot", f"--config={config}", f"--topology={topology}",
                 f"--compile_cache={cache}", "--json", *overrides])  # fmt: skip
  report_json, _ = json.JSONDecoder().raw_decode(log[log.index("{") :])  # stdout's JSON first
  return {f"AOT train step, {topology}": report_json["compile_s"]}


def measure(
  out: str, config: str, steps: int, aot_config: str, topology: str, aot_overrides: list[str]
) -> dict:
  cache = os.path.join(out, "cache")
  launches = []
  for launch in range(2):
    workdir = os.path.join(out, f"run{launch}")
    seconds = train_launch(config, workdir, cache, steps)
    seconds.update(sample_launch(workdir))
    if topology:
      seconds.update(aot_launch(aot_config, topology, os.path.join(cache, "aot"), aot_overrides))
    launches.append(seconds)
  return {
    "config": config,
    "steps": steps,
    "aot": {"config": aot_config, "topology": topology, "overrides": aot_overrides},
    "launches": launches,
  }


def format_markdown(r: dict) -> str:
  first, second = r["launches"]
  body = [
    [name, f"{first[name]:.1f}", f"{second[name]:.1f}", f"{first[name] / second[name]:.1f}x"]
    for name in first
  ]
  return report.table(["seconds", "first launch", "second launch", "saved"], body)


def main(argv):
  del argv
  f = flags.FLAGS
  if os.path.exists(os.path.join(f.out, "cache")):
    cli.fail(ValueError(f"{f.out}/cache exists: measure into a new --out"))
  overrides = [f"--config.{o}" for o in f.aot_override]
  r = measure(f.out, f.config, f.steps, f.aot_config, f.topology, overrides)
  table = format_markdown(r)
  print(table)
  report.save(f.out, "compile_cache", r, table)


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Results, runs and the cache go here.", required=True)
  flags.DEFINE_string("config", os.path.join(_REPO, "configs", "tiny.py"), "Run config.")
  flags.DEFINE_integer("steps", 5, "Training steps per launch (configs/tiny.py: 2 NTP, 3 SBD).")
  flags.DEFINE_string("aot_config", os.path.join(_REPO, "configs", "llama8b.py"), "AOT config.")
  flags.DEFINE_string("topology", "v5p-128", "TPU slice of the AOT rows; empty: none.")
  flags.DEFINE_multi_string("aot_override", [], "field=value for the AOT config, e.g. "
                            "model.attention_impl=chunked (repeatable).")  # fmt: skip
  cli.run(main)
