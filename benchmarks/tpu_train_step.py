"""The 8B fine-tune's train step on TPU slices, NTP against SBD, by the step estimate of
`python -m sbd_jax.aot` (`tpu.step_time`), calibrated against a published measurement.

    python -m benchmarks.tpu_train_step --out=DIR [--cases=calibration,recipe]
        [--configs=llama8b,qwen3_8b] [--slices=v5p-128,v6e-256] [--nomemory]

Calibration: this project's NTP step in MaxText's published Llama-3.1-8B setting (v6e-8,
sequence 8192, 3 rows per chip, bf16, splash blocks of 2048, fsdp over the slice), set beside
MaxText's measured 3.44 s per step, 7,139 tokens/s/chip (MaxText's README, `llama3_1_8b_8192`).
The ratio measured / estimated is printed next to every estimate: a calibrated step time is the
estimate times that ratio. The SBD step in the same setting gives the SBD / NTP ratio there.

Recipe: the paper's fine-tune (`configs/llama8b.py`, `configs/qwen3_8b.py`: 64 rows x 32k,
k ~ U{2..16}), NTP and SBD steps, on each slice; a v6e-256 holds the 64 rows with fsdp 64 x
tensor 4 (fsdp alone needs a row per chip). Each case compiles the step unrolled with one and
two layers (the estimate) and the whole scanned step (memory per chip; `--nomemory` skips it).
Writes DIR/results.json (after every case), DIR/tpu_train_step.md and DIR/tpu_train_step.png,
each with every case finished in DIR, by this run or an earlier one.
A finished case is kept in results.json and not compiled again when the command is rerun; one
estimated with `--nomemory` gets its memory per chip (the whole step alone) from a rerun without.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

import sbd_jax
from benchmarks import report as report_lib
from sbd_jax import cli
from sbd_jax import config as config_lib

_REPO = os.path.dirname(os.path.dirname(sbd_jax.__file__))

# MaxText's published Llama-3.1-8B step on a v6e-8 (README's performance table).
PUBLISHED = {
  "step_s": 3.44,
  "tokens_per_s_per_chip": 7139,
  "source": "MaxText llama3_1_8b_8192, v6e-8",
}
# The TPU flags of that run that this step needs to compile: splash blocks of 2048 need more
# scoped VMEM than the default (MaxText's DENSE_VMEM_LIMIT_FLAG).
CALIBRATION_OPTIONS = {"xla_tpu_scoped_vmem_limit_kib": 98304}
MESH_FOR_64_ROWS = {"v5p-128": (1, -1, 1), "v6e-256": (1, 64, 4)}


def cases(which: list[str], configs: list[str], slices: list[str]) -> list[dict]:
  out = []
  if "calibration" in which:
    for objective in ("ntp", "sbd"):
      out.append(
        dict(
          name=f"calibration llama8b v6e-8 {objective}",
          config="llama8b",
          topology="v6e-8",
          objective=objective,
          overrides={
            "train.seq_len": 8192,
            "train.batch_size": 24,
            "model.attention_chunk": 2048,
          },
          compiler_options=CALIBRATION_OPTIONS,
        )
      )
  if "recipe" in which:
    for config in configs:
      for topology in slices:
        for objective in ("ntp", "sbd"):
          mesh = MESH_FOR_64_ROWS.get(topology, (1, -1, 1))
          out.append(
            dict(
              name=f"recipe {config} {topology} {objective}",
              config=config,
              topology=topology,
              objective=objective,
              overrides={"mesh.shape": mesh},
              compiler_options=CALIBRATION_OPTIONS,
            )
          )
  return out


def case_config(case: dict):
  c = config_lib.from_file(os.path.join(_REPO, "configs", f"{case['config']}.py"))
  c.update_from_flattened_dict(case["overrides"])
  return c


def run_case(case: dict, memory: bool) -> dict:
  """One case's step estimate (the step compiled with one and two layers) and, with `memory`,
  the whole scanned step's memory per chip (one more compilation, the longest; a step that
  does not fit keeps its estimate and gets the compiler's error)."""
  from sbd_jax import sharding
  from sbd_jax.tpu import report, step_time
  from sbd_jax.tpu.topology import CHIPS, parse_topology, topology_devices

  c = case_config(case)
  c.sbd.mode = case["objective"]
  start = time.perf_counter()
  generation, topology = parse_topology(case["topology"])
  devices = topology_devices(topology)
  mesh = sharding.mesh_from_config(c.mesh, devices)
  peak = CHIPS[generation].peak_flops  # one device per chip on these generations
  e = step_time.estimate_train_step(c, devices, dict(mesh.shape), peak, case["compiler_options"])
  r = {"batch_size": c.train.batch_size, "seq_len": c.train.seq_len, "mesh": dict(mesh.shape)}
  r.update(step_time.model_flops(c, len(devices)))
  r["estimate"] = report.estimate_fields(e, r, peak, len(devices))
  r.update(case=case, wall_s=round(time.perf_counter() - start, 1))
  return {**r, **case_memory(case)} if memory else r


MEMORY_FIELDS = ("bytes_per_device", "hbm_per_device", "fits", "compiler_error")


def has_memory(result: dict) -> bool:
  return "bytes_per_device" in result or "compiler_error" in result


def case_memory(case: dict) -> dict:
  """The whole scanned step's memory per chip (XLA's memory analysis, or its error)."""
  from sbd_jax.tpu import report

  start = time.perf_counter()
  r = report.report(
    case_config(case),
    case["topology"],
    objective=case["objective"],
    compiler_options=case["compiler_options"],
  )
  out = {k: r[k] for k in MEMORY_FIELDS if k in r}
  return {**out, "memory_wall_s": round(time.perf_counter() - start, 1)}


def format_markdown(results: list[dict]) -> str:
  by_name = {r["case"]["name"]: r for r in results}
  cal = by_name.get("calibration llama8b v6e-8 ntp")
  ratio = PUBLISHED["step_s"] / cal["estimate"]["step_s"] if cal else None
  gib = 2**30
  rows = []
  for r in results:
    case, e = r["case"], r["estimate"]
    ntp = by_name.get(case["name"].rsplit(" ", 1)[0] + " ntp")
    over_ntp = ""
    if ntp and case["objective"] == "sbd":
      over_ntp = f"{e['step_s'] / ntp['estimate']['step_s']:.2f}x"
    memory = r.get("bytes_per_device", {}).get("total")
    if memory:
      memory_cell = f"{memory / gib:.1f} / {r['hbm_per_device'] / gib:.0f}"
    else:
      memory_cell = "does not fit" if r.get("fits") is False else ""
    rows.append(
      [
        case["config"],
        case["topology"] + ("" if case["name"].startswith("recipe") else " (calibration)"),
        case["objective"].upper(),
        f"{r['batch_size']} x {r['seq_len']}",
        f"{e['xla_step_s']:.3g}",
        f"{e['corrected_xla_step_s']:.3g}",
        f"{e['splash_at_peak_s']:.3g}",
        f"**{e['step_s']:.3g}**",
        over_ntp,
        f"{e['step_s'] * ratio:.3g}" if ratio else "",
        f"{e['tokens_per_s_per_chip'] / ratio:,.0f}" if ratio else "",
        f"{100 * e['mfu'] / ratio:.1f}" if ratio else "",
        f"{100 * e['processed_mfu'] / ratio:.1f}" if ratio else "",
        memory_cell,
      ]
    )
  header = [
    "config", "slice", "step", "rows x L", "XLA s", "with uncounted matmuls s", "+ splash at peak s",
    "estimate s", "SBD / NTP", "calibrated s", "tokens/s/chip", "MFU %", "processed-token MFU %",
    "memory GiB / HBM",
  ]  # fmt: skip
  lines = [report_lib.table(header, rows)]
  if ratio:
    lines.append(
      f"\nCalibration: MaxText's measured {PUBLISHED['step_s']} s ({PUBLISHED['source']}) / this "
      f"project's NTP step estimated at {cal['estimate']['step_s']:.3g} s in the same setting = "
      f"{ratio:.2f}. Calibrated columns are the estimate x {ratio:.2f}."
    )
  return "\n".join(lines)


def plot(results: list[dict], path: str) -> report_lib.Series:
  """Each case's estimate as a stacked bar (XLA's cost model; the matmuls it does not count;
  splash at peak), MaxText's measured step beside the calibration case."""
  labels = [
    r["case"]["name"].replace("calibration ", "cal. ").replace("recipe ", "") for r in results
  ]
  parts = {
    "XLA's cost model": [r["estimate"]["xla_step_s"] for r in results],
    "matmuls XLA does not count": [
      r["estimate"]["corrected_xla_step_s"] - r["estimate"]["xla_step_s"] for r in results
    ],
    "splash kernels at peak": [r["estimate"]["splash_at_peak_s"] for r in results],
  }
  drawn: report_lib.Series = {"estimated step (s)": {}}
  with report_lib.figure(path, 1, size=(1.2 * len(results) + 3, 4.2)) as (ax,):
    xs, bottom = list(range(len(results))), [0.0] * len(results)
    for label, heights in parts.items():
      ax.bar(xs, heights, bottom=bottom, label=label)
      bottom = [b + h for b, h in zip(bottom, heights)]
      drawn["estimated step (s)"][label] = (xs, heights)
    for x, r in zip(xs, results):
      if r["case"]["name"] == "calibration llama8b v6e-8 ntp":
        ax.plot([x], [PUBLISHED["step_s"]], "k*", markersize=12, label="MaxText measured")
        drawn["estimated step (s)"]["MaxText measured"] = ([x], [PUBLISHED["step_s"]])
    ax.set_xticks(xs, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds per step")
    ax.set_title("8B train step on TPU, by XLA's cost model")
    ax.legend(fontsize=8)
  return drawn


def _define_flags():
  flags.DEFINE_list("cases", ["calibration", "recipe"], "calibration and / or recipe.")
  flags.DEFINE_list("configs", ["llama8b", "qwen3_8b"], "Recipe configs (configs/NAME.py).")
  flags.DEFINE_list("slices", ["v5p-128", "v6e-256"], "Recipe slices.")
  flags.DEFINE_bool("memory", True, "Also compile the whole scanned step: memory per chip.")
  flags.DEFINE_string("out", None, "Directory for results.json and tpu_train_step.md.")
  flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  f = flags.FLAGS
  path = os.path.join(f.out, "results.json")
  done = {}
  if os.path.exists(path):
    with open(path) as fh:
      done = {r["case"]["name"]: r for r in json.load(fh)["results"]}
  for case in cases(f.cases, f.configs, f.slices):
    if case["name"] not in done:
      print(f"{case['name']}: compiling", file=sys.stderr, flush=True)
      done[case["name"]] = run_case(case, f.memory)
    elif f.memory and not has_memory(done[case["name"]]):
      print(f"{case['name']}: compiling the whole step for memory", file=sys.stderr, flush=True)
      done[case["name"]].update(case_memory(case))
    os.makedirs(f.out, exist_ok=True)
    with open(path, "w") as fh:  # after every case: an interrupted run keeps what it finished
      json.dump({"results": list(done.values())}, fh, indent=1)
    r = done[case["name"]]
    print(f"{case['name']}: estimate {r['estimate']['step_s']:.3g} s ({r['wall_s']} s)", flush=True)
  results = list(done.values())  # every finished case, this run's and earlier runs'
  out = {"published": PUBLISHED, "results": results}
  report_lib.save(
    f.out, "tpu_train_step", out, format_markdown(results), lambda path: plot(results, path)
  )
  print(format_markdown(results))


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
