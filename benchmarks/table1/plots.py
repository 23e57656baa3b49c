"""The Table-1 benchmark's figures: accuracy against NFE speedup per reveal rule, measured
against predicted wall-clock speedup, and cached forward time against new tokens. Each returns
the series it drew (`report.drawn`)."""

from __future__ import annotations

import os
from typing import Any

from benchmarks import report


def accuracy_vs_speedup(results: dict[str, Any], path: str) -> report.Series:
  """One panel per rule: accuracy against NFE speedup, one point per γ (paper Figures 1, 5)."""
  sweeps = results["arithmetic"]["sweeps"]
  rows = results["arithmetic"]["rows"]
  with report.figure(path, len(sweeps)) as axes:
    for ax, (rule, sweep) in zip(axes, sweeps.items()):
      xs = [r["nfe_speedup"] for r in sweep]
      ys = [r["accuracy"] for r in sweep]
      ax.plot(xs, ys, "o-", label="SBD model, SBD decoding")
      for r in sweep:
        ax.annotate(
          f"{r['gamma']:g}",
          (r["nfe_speedup"], r["accuracy"]),
          fontsize=7,
          textcoords="offset points",
          xytext=(3, 3),
        )
      ax.axhline(rows["sbd_model_ntp"]["accuracy"], color="C1", ls="--", label="SBD model, NTP")
      ax.axhline(rows["ntp_model_ntp"]["accuracy"], color="C2", ls=":", label="NTP model, NTP")
      ax.set_title(rule)
      ax.set_xlabel(f"NFE speedup (x), {'threshold f' if rule == 'factor' else 'γ'} labelled")
      ax.set_ylabel("exact-match accuracy")
      ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return report.drawn(axes)


def wallclock_vs_predicted(results: dict[str, Any], path: str) -> report.Series:
  """Measured wall-clock speedup (medians, fastest calls), both predictions from measured
  time(n), and NFE speedup, against γ."""
  rows = results["wallclock"]["sbd"]
  gammas = [r["gamma"] for r in rows]
  with report.figure(path, 1, size=(5.5, 4)) as (ax,):
    for key, label, style in (
      ("nfe_speedup", "NFE speedup", "k--"),
      ("measured_speedup", "measured wall-clock", "o-"),
      ("predicted_speedup", "predicted: forward counts and prefill", "^-"),
      ("fastest_measured_speedup", "measured, fastest calls", "o:"),
      ("predicted_paper", "paper: k·t(1)/(t(2k)+(l-1)t(k))", "s-"),
    ):
      ax.plot(gammas, [r[key] for r in rows], style, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(f"γ ({rows[0]['rule']})")
    ax.set_ylabel("speedup over NTP decoding (x)")
    ax.set_title(f"decode batch {results['wallclock']['batch_size']}, same model and cache")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return report.drawn([ax])


def time_per_forward(results: dict[str, Any], path: str) -> report.Series:
  """time(n) for n new tokens over a filled cache, and time(n) / time(1)."""
  fwd = results["wallclock"]["forward"]
  ns = sorted(int(n) for n in fwd["time_s"])
  ms = [1e3 * fwd["time_s"][str(n)] for n in ns]
  with report.figure(path, 2) as (ax1, ax2):
    ax1.plot(ns, ms, "o-", label="ms per forward")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("new tokens per sequence n")
    ax1.set_ylabel("ms per forward")
    ax1.set_title(f"batch {fwd['batch']}, {fwd['cached_tokens']} cached tokens")
    ax2.plot(ns, [m / ms[0] for m in ms], "o-", label="measured")
    ax2.plot(ns, ns, "k--", lw=0.8, label="linear in n")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("new tokens per sequence n")
    ax2.set_ylabel("time(n) / time(1)")
    ax2.set_title("time(n) / time(1)")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
      ax.grid(alpha=0.3)
    return report.drawn([ax1, ax2])


FIGURES = {
  "accuracy_vs_speedup.png": accuracy_vs_speedup,
  "wallclock_vs_predicted.png": wallclock_vs_predicted,
  "time_per_forward.png": time_per_forward,
}


def write_all(results: dict[str, Any], out_dir: str) -> dict[str, report.Series]:
  """Every figure into `out_dir`: {file name: the series it drew}."""
  return {name: draw(results, os.path.join(out_dir, name)) for name, draw in FIGURES.items()}
