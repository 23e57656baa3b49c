"""The Table-1 benchmark's markdown report: laid out like the paper's Table 1, with γ sweeps,
wall-clock and time(n)."""

from __future__ import annotations

from typing import Any

from benchmarks import report
from benchmarks.table1.sizes import GAMMA_HIGH, GAMMA_LOW, PAPER_BENCHMARKS, PAPER_LLAMA
from sbd_jax.evals import stats


def _ci(accuracy: float, n: int) -> str:
  """The Wilson 95 % interval of an accuracy over n problems, in percent."""
  lo, hi = stats.wilson_interval(round(accuracy * n), n)
  return f"[{100 * lo:.1f}, {100 * hi:.1f}]"


def _acc(row: dict[str, Any] | None, n: int) -> str:
  if row is None:
    return "-"
  return f"{100 * row['accuracy']:.1f} {_ci(row['accuracy'], n)} ({row['nfe_speedup']:.2f}x)"


def _paper(cell: tuple[float, float | None]) -> str:
  acc, speed = cell
  return f"{acc:.1f}" if speed is None else f"{acc:.1f} ({speed:.2f}x)"


def format_table1(results: dict[str, Any]) -> str:
  """Markdown laid out like the paper's Table 1, with the paper's Llama-3.1 8B rows beside it,
  then the γ sweeps, the wall-clock comparison and time(n)."""
  sections = (_table1_section, _sweep_section, _wallclock_section, _forward_section)
  return "\n".join(line for section in sections for line in section(results))


def _table1_rows(results: dict[str, Any]) -> list[list[str]]:
  """One row per (model, decoding): accuracy, code speedup, held-out losses, the paper's cells."""
  a, c, losses = results["arithmetic"]["rows"], results["code"]["rows"], results["heldout_loss"]
  n = results["arithmetic"]["num_problems"]
  names = {"ntp": "NTP-trained", "sbd": "SBD-trained", "matp_only": "MATP-only (ablation)"}
  body = []
  for model in results["models"]:
    decodings = (
      [("ntp", "NTP")]
      if model == "ntp"
      else [
        ("ntp", "NTP"),
        ("gamma_low", f"SBD γ_low={GAMMA_LOW:g}"),
        ("gamma_high", f"SBD γ_high={GAMMA_HIGH:g}"),
      ]
    )
    for key, label in decodings:
      row_key = f"{model}_model_ntp" if key == "ntp" else f"{model}_{key}"
      g = {"gamma_low": GAMMA_LOW, "gamma_high": GAMMA_HIGH}.get(key)
      code_row = c.get(f"{model}_gamma_{g:g}") if g is not None else None
      code = (
        "1.00x"
        if key == "ntp"
        else f"{code_row['nfe_speedup']:.2f}x ({code_row['agreement']:.2f})"
        if code_row
        else "-"
      )
      paper = PAPER_LLAMA.get(row_key if model != "matp_only" else "", None)
      body.append(
        [
          names[model],
          label,
          _acc(a.get(row_key), n),
          code,
          f"{losses['arithmetic'][model]['loss']:.4f}",
          f"{losses['code'][model]['loss']:.4f}",
          _paper(paper[2][3]) if paper else "-",
          _paper(paper[2][4]) if paper else "-",
        ]
      )
  return body


def _table1_section(results: dict[str, Any]) -> list[str]:
  size = results["config"]
  header = [
    "model",
    "decoding",
    "arithmetic acc % [95 % CI] (NFE speedup)",
    "code NFE speedup (agreement w/ NTP)",
    "held-out NTP loss, arithmetic",
    "held-out NTP loss, code",
    "paper Llama-3.1 8B GSM8K",
    "paper Llama-3.1 8B HE+",
  ]
  body = _table1_rows(results)
  lines = [
    f"# Table 1 at small scale (size `{results['size']}`)",
    "",
    f"Model: {results['num_params'] / 1e6:.2f}M parameters ({size['model']}); arithmetic: "
    f"{size['steps']} steps of {size['batch_size']}x{size['seq_len']}; code (Python stdlib): "
    f"{size['code_steps']} steps of {size['code_batch_size']}x{size['code_seq_len']}; same data "
    f"and seed for every model. {results['arithmetic']['num_problems']} held-out problems, "
    f"block k={size['block_size']}, max {results['arithmetic']['max_new_tokens']} new tokens, "
    "greedy; EB "
    "entropy rule. NFE speedup = the same model's NTP forwards / SBD forwards per sample, to "
    "EOS, averaged. "
    f"Code: {results['code']['num_prompts']} held-out files, first {size['code_prompt_len']} "
    f"tokens continued by {size['code_new_tokens']}; agreement = fraction of the NTP "
    "continuation's tokens matched at the same position. Losses in nats per target token.",
    "",
    report.table(header, body),
    "",
    "## Paper, Table 1 (Llama-3.1 8B rows, accuracy % and NFE speedup)",
    "",
    report.table(
      ["model", "decoding", *PAPER_BENCHMARKS],
      [[m, d, *(_paper(x) for x in cells)] for m, d, cells in PAPER_LLAMA.values()],
    ),
    "",
  ]
  return lines


def _sweep_section(results: dict[str, Any]) -> list[str]:
  lines = ["## γ sweeps (SBD model, arithmetic)", ""]
  n = results["arithmetic"]["num_problems"]
  sweep_rows = [
    [
      rule,
      f"{r['gamma']:g}",
      f"{100 * r['accuracy']:.1f}",
      _ci(r["accuracy"], n),
      f"{r['mean_nfe']:.1f}",
      f"{r['nfe_speedup']:.2f}x",
    ]
    for rule, rows in results["arithmetic"]["sweeps"].items()
    for r in rows
  ]
  return lines + [
    report.table(["rule", "γ / f", "accuracy %", "95 % CI", "mean NFE", "NFE speedup"], sweep_rows),
    "",
  ]


def _wallclock_section(results: dict[str, Any]) -> list[str]:
  w = results["wallclock"]
  f = w["forward"]
  lines = [
    f"## Wall-clock (same process, model and cache; decode batch {w['batch_size']}, "
    f"{w['num_prompts']} problems, {w['device']})",
    "",
    "Decodes and time(n) loops are timed in the same rounds, each decode call right after an "
    f"untimed one (NTP: {w['repeats']} timed calls); time(n) at one cache fill per step of "
    "attention's cost over the slots the decodes' keys reach, weighted (`forward_timing.fill_steps`; "
    f"time(2k)'s mean fill: {f['cached_tokens']} cached tokens). "
    "predicted: NTP's forwards at time(1), SBD's at time(2k) for a block's first and time(k) "
    "for the others, with each batch's own forward counts, and each decode's first forward "
    f"at its measured prefill (NTP {1e3 * w['prefill_s']['ntp']:.3f} ms, SBD prompt + first "
    f"block {1e3 * w['prefill_s']['sbd']:.3f} ms). Medians, then fastest calls "
    "(`forward_timing`).",
    "",
    f"NTP: {1e3 * w['ntp']['s_per_token']:.3f} ms per generated token.",
    "",
  ]
  wall_rows = [
    [
      f"{r['gamma']:g}",
      f"{1e3 * r['s_per_token']:.3f}",
      f"{r['nfe_speedup']:.2f}x",
      f"{r['measured_speedup']:.2f}x",
      f"{r['predicted_speedup']:.2f}x",
      f"{r['measured_over_predicted']:.2f}",
      f"{r['fastest_measured_speedup']:.2f}x",
      f"{r['fastest_measured_over_predicted']:.2f}",
      f"{r['forwards_per_block']:.2f}",
      f"{r['predicted_paper']:.2f}x",
    ]
    for r in w["sbd"]
  ]
  lines += [
    report.table(
      [
        "γ (eb_entropy)",
        "ms / token",
        "NFE speedup",
        "wall-clock speedup",
        "predicted",
        "measured / predicted",
        "fastest calls: speedup",
        "measured / predicted",
        "forwards per block l",
        "paper: k·t(1)/(t(2k)+(l-1)t(k))",
      ],
      wall_rows,
    ),
    "",
  ]
  return lines


def _loop_lengths(inner: Any) -> str:
  """The timed loop's extra forwards: one count (older results) or one per n."""
  if not isinstance(inner, dict):
    return str(inner)
  return ", ".join(f"{m} at n={n}" for n, m in inner.items())


def _forward_section(results: dict[str, Any]) -> list[str]:
  f = results["wallclock"]["forward"]
  ns = sorted(int(n) for n in f["time_s"])
  return [
    f"### time(n): one cached forward over n new tokens (batch {f['batch']}, "
    f"{f['cached_tokens']} cached tokens on average; slope between loops of 1 and 1 + m forwards, "
    f"{f['repeats']} repeats, m = {_loop_lengths(f['inner'])})",
    "",
    report.table(
      ["n", *map(str, ns)],
      [
        ["ms", *(f"{1e3 * f['time_s'][str(n)]:.3f}" for n in ns)],
        ["time(n)/time(1)", *(f"{f['ratio_to_time1'][str(n)]:.2f}" for n in ns)],
      ],
    ),
    "",
    "Roofline Tables 3/4 (H100 and the given device): see roofline.md.",
    "",
  ]
