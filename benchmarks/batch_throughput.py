"""Batched decoding of a trained model: tokens per second, forwards and rows busy by batch size,
for NTP and for SBD with rows moving through their blocks alone and in lockstep, each batch
decoded until its last row is done; and for NTP and SBD with refill, every prompt queued for
one set of rows, a finished row taking the next prompt (`sbd_jax.decode.queue`).

    python -m benchmarks.batch_throughput --workdir=/tmp/sbd_tiny --out=DIR
        [--batches=1,8,32,128] [--problems=256] [--gammas=0.1,0.35] [--repeats=3]
        [--refill_rows=1]

The same `--problems` held-out problems (seed 0) are decoded at every batch size, greedy, with
the model's own block size and EOS enabled. Per (batch size, decoding):
- generated tokens per second: the median of warm timed calls over all the problems (each
  timed call right after an untimed one of the same program; compilation apart);
- batch forwards: the forwards the batches ran, summed over batches, and of them the wide ones
  (2k tokens: a row starting a block), after each batch's first forward. With refill, the
  B-row forwards plus one single-row prefill per prompt (the `prefills` column);
- rows busy: the rows' NFE over the row-forwards spent (`evals.stats.rows_busy`; with
  refill a prompt is charged the forwards its row ran while holding it, and a row whose
  queue ran dry is charged to the end);
- tokens per second and batch forwards relative to NTP at the same batch size.

Forward counts do not depend on the machine; tokens per second do (on a CPU a forward of more
rows or tokens costs proportionally more, on an accelerator at small batch about the same).
Outputs: DIR/results.json (`rows`), DIR/batch_throughput.md, DIR/batch_throughput.png.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags

from benchmarks import decode_timing, report
from sbd_jax import cli
from sbd_jax.decode import settings as settings_lib
from sbd_jax.decode.settings import SamplerSettings
from sbd_jax.evals import runner, stats
from sbd_jax.evals.tasks import arithmetic as arithmetic_task
from sbd_jax.run import loading
from sbd_jax.run import workdir as workdir_lib


def decodings(base: SamplerSettings, gammas: Sequence[float], refill_rows: Sequence[int] = (1,)):
  """(name, settings): NTP, then per γ SBD in lockstep and with rows moving alone; then per
  entry of `refill_rows` (rows refilled together), NTP and per γ SBD with refill."""
  out = [("NTP", base.replace(mode="ntp"))]
  for g in gammas:
    sbd = base.replace(rule="eb_entropy", gamma=float(g))
    out += [
      (f"SBD γ={g:g} lockstep", sbd.replace(lockstep=True)),
      (f"SBD γ={g:g} alone", sbd.replace(lockstep=False)),
    ]
  for together in refill_rows:
    refill = base.replace(refill=True, refill_rows=together)
    suffix = "refill" if together == 1 else f"refill {together} at once"
    out.append((f"NTP {suffix}", refill.replace(mode="ntp")))
    for g in gammas:
      out.append((f"SBD γ={g:g} {suffix}", refill.replace(gamma=float(g))))
  return out


def measure(
  workdir: str,
  *,
  batches: Sequence[int],
  problems: int,
  gammas: Sequence[float],
  repeats: int,
  refill_rows: Sequence[int] = (1,),
  log=print,
) -> list[dict[str, Any]]:
  """One row per (batch size, decoding); see the module docstring."""
  model, config, tokenizer, mask_id = loading.load_sampling_model(workdir)
  held_out = arithmetic_task.problems(config.data, problems, seed=0)
  budget = runner.reference_budget(held_out, tokenizer, config.sample.block_size)
  # Plain SBD: how batches and refill pace the paper's decode.
  base = settings_lib.from_config(config.sample, tokenizer, mask_id, budget=budget, verify=False)
  prompts = [tokenizer.encode_document(p.plain_prompt) for p in held_out]
  named = decodings(base, gammas, refill_rows)
  rows = []
  for batch in batches:
    t0 = time.perf_counter()
    timed = decode_timing.time_decodes(
      model, prompts, [s for _, s in named], batch_size=batch, repeats=repeats,
      log=lambda _: None, warm=True,
    )  # fmt: skip
    ntp = None
    for (name, s), d in zip(named, timed):
      forwards = d["loop_forwards"]
      r = {
        "batch": batch,
        "decoding": name,
        "gamma": s.gamma if s.mode == "sbd" else None,
        "lockstep": s.lockstep if s.mode == "sbd" else None,
        "refill": s.refill,
        "refill_rows": s.refill_rows if s.refill else None,
        "tokens": d["tokens"],
        "median_s": d["median_s"],
        "tokens_per_s": d["tokens"] / d["median_s"],
        "mean_nfe": float(np.mean(d["nfe"])),
        "batch_forwards": forwards,
        "prefills": d["prefills"],
        "wide_forwards": d["loop_wide_forwards"],
        "rows_busy": stats.rows_busy(np.asarray(d["nfe"]), np.asarray(d["batch_forwards"])),
      }
      if s.mode == "ntp":  # the reference of the SBD rows after it (refill or not, as it)
        ntp = r
      r["speedup_vs_ntp"] = r["tokens_per_s"] / ntp["tokens_per_s"]
      r["forwards_vs_ntp"] = ntp["batch_forwards"] / forwards
      rows.append(r)
    log(
      f"batch {batch}: "
      + ", ".join(
        f"{r['decoding']} {r['tokens_per_s']:.0f} tok/s ({r['batch_forwards']} fwd, "
        f"{100 * r['rows_busy']:.0f} % busy)"
        for r in rows[-len(named) :]
      )
      + f" [{time.perf_counter() - t0:.0f} s]"
    )
  return rows


def format_markdown(rows: Sequence[dict[str, Any]]) -> str:
  header = [
    "batch",
    "decoding",
    "tok/s",
    "vs NTP",
    "batch forwards",
    "of them wide",
    "of them prefills",
    "fewer than NTP",
    "rows busy %",
    "mean NFE",
  ]
  body = [
    [
      str(r["batch"]),
      r["decoding"],
      f"{r['tokens_per_s']:.0f}",
      f"{r['speedup_vs_ntp']:.2f}x",
      str(r["batch_forwards"]),
      str(r["wide_forwards"]),
      str(r["prefills"]),
      f"{r['forwards_vs_ntp']:.2f}x",
      f"{100 * r['rows_busy']:.1f}",
      f"{r['mean_nfe']:.1f}",
    ]
    for r in rows
  ]
  return report.table(header, body)


def plot(rows: Sequence[dict[str, Any]], path: str) -> report.Series:
  """Tokens per second and rows busy against batch size, one line per decoding (lockstep
  dashed, refill dotted, refill of several rows at once dash-dotted). Returns what it drew."""
  names = list(dict.fromkeys(r["decoding"] for r in rows))
  gammas = sorted({r["gamma"] for r in rows if r["gamma"] is not None})
  with report.figure(path, 2, size=(5, 3.8)) as (speed, busy):
    for name in names:
      line = sorted((r for r in rows if r["decoding"] == name), key=lambda r: r["batch"])
      xs = [r["batch"] for r in line]
      gamma = line[0]["gamma"]
      color = "black" if gamma is None else f"C{gammas.index(gamma)}"
      if line[0]["refill"]:
        style = ":" if line[0]["refill_rows"] == 1 else "-."
      else:
        style = "--" if line[0]["lockstep"] else "-"
      speed.plot(xs, [r["tokens_per_s"] for r in line], "o" + style, color=color, label=name)
      busy.plot(xs, [100 * r["rows_busy"] for r in line], "o" + style, color=color, label=name)
    for ax, title in ((speed, "generated tokens per second"), (busy, "rows busy %")):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("batch size")
      ax.set_title(title)
      ax.grid(alpha=0.3)
    speed.legend(fontsize=7)
    return report.drawn((speed, busy))


def _define_flags():
  flags.DEFINE_string("workdir", None, "A trained workdir (config.json, params/).")
  flags.DEFINE_string("out", None, "Output directory (results.json, batch_throughput.md/.png).")
  flags.DEFINE_list("batches", ["1", "8", "32", "128"], "Batch sizes.")
  flags.DEFINE_integer("problems", 256, "Held-out problems decoded at every batch size.")
  flags.DEFINE_list("gammas", ["0.1", "0.35"], "γ of the EB-entropy SBD decodings.")
  flags.DEFINE_integer("repeats", 3, "Timed calls per decoding and batch size (median).")
  flags.DEFINE_list(
    "refill_rows", ["1"], "Refill decodings: rows refilled together (empty: no refill rows)."
  )
  flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    batches = [int(b) for b in f.batches]
    gammas = [float(g) for g in f.gammas]
    refill_rows = [int(g) for g in f.refill_rows]
    if min(batches + refill_rows) < 1 or f.problems < 1 or f.repeats < 1:
      raise ValueError("--batches, --refill_rows, --problems and --repeats must be >= 1")
    if any(g < 0 for g in gammas):
      raise ValueError(f"--gammas must be >= 0, got {f.gammas}")
    workdir_lib.read_trained_config(f.workdir)  # a missing or untrained workdir fails here
  except (ValueError, FileNotFoundError) as e:
    cli.fail(e)
  start = time.perf_counter()

  def log(message: str) -> None:
    print(f"[{time.perf_counter() - start:6.0f}s] {message}", file=sys.stderr, flush=True)

  log(f"devices: {jax.devices()}")
  rows = measure(
    f.workdir, batches=batches, problems=f.problems, gammas=gammas, repeats=f.repeats,
    refill_rows=refill_rows, log=log,
  )  # fmt: skip
  results = {
    "device": str(jax.devices()[0].device_kind),
    "workdir": f.workdir,
    "problems": f.problems,
    "repeats": f.repeats,
    "seconds": time.perf_counter() - start,
    "rows": rows,
  }
  table = format_markdown(rows)
  report.save(f.out, "batch_throughput", results, table, lambda path: plot(rows, path))
  print(table)
  log(f"wrote {f.out}/results.json, batch_throughput.md, batch_throughput.png")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
