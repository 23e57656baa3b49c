"""The paper's Tables 3 and 4 (section 4) recomputed from the roofline cost model
(`roofline_model`): the slowdown of a block forward against a one-token forward, and the
wall-clock speedup an NFE speedup gives, for the paper's 8B model on its H100 constants.

    python -m benchmarks.roofline [--out=DIR]       # DIR/roofline.md, results.json

Pure arithmetic: seconds, any machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from absl import flags

from benchmarks import report
from benchmarks.roofline_model import (
  H100_FP8,
  Device,
  Model,
  block_slowdown,
  layer_matmul_shapes,
  paper_8b,
  wallclock_speedup_from_nfe,
)
from sbd_jax import cli

DEFAULT_KV_LEN = 1024
BATCH_SIZES = (1, 8, 16, 32, 64)
BLOCK_SIZES = (2, 4, 8, 16, 32)
KV_LENS = (0, 1024, 4096, 32768)
NFE_SPEEDUPS = (2.0, 3.0, 4.0, 5.0)

# Values the paper prints (section 4, Tables 3-4), keyed as below.
PAPER_TABLE3 = {1: 1.004, 8: 1.029, 16: 1.058}  # batch -> slowdown at block 16
PAPER_TABLE4 = {(1, 16, 4.0): 3.98}  # (batch, block, NFE speedup) -> wall-clock speedup


@dataclasses.dataclass(frozen=True)
class Table3Row:
  batch: int
  kv_len: int
  block_size: int
  slowdown: float
  slowdown_paper_shapes: float
  paper_printed: float | None


@dataclasses.dataclass(frozen=True)
class Table4Row:
  batch: int
  kv_len: int
  block_size: int
  nfe_speedup: float
  speedup: float
  speedup_paper_shapes: float
  paper_printed: float | None


def table3(
  model: Model | None = None,
  device: Device = H100_FP8,
  batch_sizes: Sequence[int] = BATCH_SIZES,
  block_sizes: Sequence[int] = BLOCK_SIZES,
  kv_lens: Sequence[int] = (DEFAULT_KV_LEN,),
  include_lm_head: bool = False,
) -> list[Table3Row]:
  """Slowdown of a block forward vs a 1-token forward over kv_len x batch x block size."""
  model = paper_8b() if model is None else model
  rows = []
  for kv_len in kv_lens:
    for batch in batch_sizes:
      for k in block_sizes:
        rows.append(
          Table3Row(
            batch=batch,
            kv_len=kv_len,
            block_size=k,
            slowdown=block_slowdown(
              model, device, batch, k, kv_len, include_lm_head=include_lm_head
            ),
            slowdown_paper_shapes=block_slowdown(
              model, device, batch, k, kv_len, paper_shapes=True, include_lm_head=include_lm_head
            ),
            paper_printed=PAPER_TABLE3.get(batch) if k == 16 else None,
          )
        )
  return rows


def table4(
  model: Model | None = None,
  device: Device = H100_FP8,
  batch_sizes: Sequence[int] = BATCH_SIZES,
  nfe_speedups: Sequence[float] = NFE_SPEEDUPS,
  block_size: int = 16,
  kv_len: int = DEFAULT_KV_LEN,
  include_lm_head: bool = False,
) -> list[Table4Row]:
  """Wall-clock speedup over batch x NFE speedup at a fixed block size and kv_len."""
  model = paper_8b() if model is None else model
  rows = []
  for batch in batch_sizes:
    for s in nfe_speedups:
      kw = dict(include_lm_head=include_lm_head)
      rows.append(
        Table4Row(
          batch=batch,
          kv_len=kv_len,
          block_size=block_size,
          nfe_speedup=s,
          speedup=wallclock_speedup_from_nfe(model, device, batch, block_size, s, kv_len, **kw),
          speedup_paper_shapes=wallclock_speedup_from_nfe(
            model, device, batch, block_size, s, kv_len, paper_shapes=True, **kw
          ),
          paper_printed=PAPER_TABLE4.get((batch, block_size, s)),
        )
      )
  return rows


def _fmt(x: float | None, digits: int = 3) -> str:
  return "-" if x is None else f"{x:.{digits}f}"


def format_table3(rows: Sequence[Table3Row]) -> str:
  """Rows: (kv_len, batch); columns: our slowdown per block size, then block 16 references."""
  blocks = sorted({r.block_size for r in rows})
  keys = sorted({(r.kv_len, r.batch) for r in rows})
  cell = {(r.kv_len, r.batch, r.block_size): r for r in rows}
  header = ["kv_len", "batch"] + [f"k={k}" for k in blocks]
  has16 = 16 in blocks
  if has16:
    header += ["k=16 paper shapes", "k=16 paper printed"]
  body = []
  for kv, b in keys:
    row = [str(kv), str(b)] + [_fmt(cell[kv, b, k].slowdown, 4) for k in blocks]
    if has16:
      r = cell[kv, b, 16]
      row += [_fmt(r.slowdown_paper_shapes, 4), _fmt(r.paper_printed)]
    body.append(row)
  return report.table(header, body)


def format_table4(rows: Sequence[Table4Row]) -> str:
  """Rows: batch; columns: our wall-clock speedup per NFE speedup, then paper-shape references."""
  speeds = sorted({r.nfe_speedup for r in rows})
  batches = sorted({r.batch for r in rows})
  cell = {(r.batch, r.nfe_speedup): r for r in rows}
  header = ["batch"] + [f"NFE {s:g}x" for s in speeds]
  header += [f"NFE {s:g}x paper shapes" for s in speeds] + ["paper printed"]
  body = []
  for b in batches:
    row = [str(b)] + [_fmt(cell[b, s].speedup, 2) for s in speeds]
    row += [_fmt(cell[b, s].speedup_paper_shapes, 2) for s in speeds]
    printed = [
      f"{cell[b, s].paper_printed:.2f} (NFE {s:g}x)" for s in speeds if cell[b, s].paper_printed
    ]
    body.append(row + [", ".join(printed) or "-"])
  return report.table(header, body)


def compute_bound_threshold(model: Model, device: Device) -> float:
  """Rows T at which a large [D, D] weight matmul turns compute-bound (activations ignored)."""
  # 2 T / peak = bytes_per_weight / bandwidth  =>  T = peak * bytes_per_weight / (2 bandwidth).
  return device.peak_matmul_flops * model.bytes_per_weight / (2 * device.bandwidth_bytes_per_s)


def explanation(model: Model, device: Device, kv_len: int) -> str:
  """Where and why our numbers differ from the paper's printed ones, with the numbers."""
  D = model.hidden
  ours = {b: block_slowdown(model, device, b, 16, kv_len) for b in (1, 8, 16)}
  paper = {b: block_slowdown(model, device, b, 16, kv_len, paper_shapes=True) for b in (1, 8, 16)}
  closed = {b: (1 + b * 16 / D) / (1 + b / D) for b in (1, 8, 16)}
  w_ours = sum(i * o for _, i, o in layer_matmul_shapes(model)) * model.bytes_per_weight
  w_paper = sum(i * o for _, i, o in layer_matmul_shapes(model, True)) * model.bytes_per_weight
  kv_bytes = kv_len * 2 * model.num_kv_heads * model.head_dim * model.bytes_per_kv
  t_star = compute_bound_threshold(model, device)
  act_per_token = sum(i + o for _, i, o in layer_matmul_shapes(model)) * model.bytes_per_activation
  ratio = act_per_token / w_ours
  s_ours = wallclock_speedup_from_nfe(model, device, 1, 16, 4.0, kv_len)
  s_paper = wallclock_speedup_from_nfe(model, device, 1, 16, 4.0, kv_len, paper_shapes=True)
  return "\n".join(
    [
      "Why the numbers differ:",
      f"* Weight bytes per layer: correct shapes {w_ours / 1e6:.0f} MB; the paper's printed "
      f"shapes (K/V [D, N*K], FFN [D, D*F]) {w_paper / 1e9:.0f} GB -- the FFN matrices are "
      f"{D} x {D * model.ffn_size / 1e6:.0f}M. Their K/V error alone is negligible; the FFN "
      "error makes every op a pure weight read whose activation traffic is ~1/D of it.",
      "* Hence the paper-shape slowdown is (1 + B k / D) / (1 + B / D): "
      + ", ".join(f"B={b}: {closed[b]:.4f} (code {paper[b]:.4f})" for b in closed)
      + " -- the printed 1.004 / 1.029 / 1.058 to the printed precision, and "
      f"{s_paper:.2f}x for Table 4 (printed 3.98x). We infer from this match that their `ffn` "
      "held the FFN width, not the 4x multiplier, and that activations were 1 byte.",
      f"* With correct shapes the weights are ~{w_paper / w_ours:.0f}x smaller, so activation "
      f"traffic and the KV cache ({kv_bytes / 1e6:.1f} MB per layer per sequence at "
      f"kv_len={kv_len}) are no longer negligible: block-16 slowdown "
      + ", ".join(f"B={b}: {ours[b]:.4f}" for b in ours)
      + f". Batch-1 wall-clock at "
      f"NFE 4x: {s_ours:.2f}x vs their {s_paper:.2f}x -- the same conclusion at small batch.",
      f"* Where the gap opens: a weight matmul turns compute-bound at about T = peak * "
      f"bytes_per_weight / (2 * bandwidth) = {t_star:.0f} rows here, for ANY shape (its "
      "intensity is ~2T FLOP per weight byte), so both shape sets collapse beyond it (B*2k = 512 "
      "rows at B=16, k=16; B*k = 512 at B=32). Below it, correct shapes give a larger slowdown "
      f"than the paper's (activation bytes per token are 1/D of weight bytes there, "
      f"{ratio * D:.2f}/D here); above it, the "
      "paper's 67M-wide FFN hides the attention/KV reads that dilute our slowdown, so theirs is "
      "larger.",
      "* KV length: attention over the cache is memory-bound and the same for n=1 and n=k, so a "
      "longer cache dilutes the slowdown (see the kv_len sweep); the paper's shapes are "
      "insensitive to kv_len because their weights dwarf the cache.",
    ]
  )


def tables(model: Model | None = None, device: Device = H100_FP8) -> dict[str, list]:
  """Table 3 at the default KV length, its KV-length sweep at block 16, and Table 4."""
  model = paper_8b() if model is None else model
  return {
    "table3": table3(model, device),
    "table3_kv_sweep": table3(
      model, device, batch_sizes=(1, 8, 16, 64), block_sizes=(16,), kv_lens=KV_LENS
    ),
    "table4": table4(model, device),
  }


def format_markdown(model: Model, device: Device, t: dict[str, list]) -> str:
  return "\n".join(
    [
      f"# SBD roofline: {model.name}, on {device.name}",
      "Layers only (no LM head / embedding), 1-byte activations, SwiGLU MLP.\n",
      f"## Table 3: time(block of k) / time(1 token), kv_len = {DEFAULT_KV_LEN}\n",
      format_table3(t["table3"]),
      "\n## Table 3, kv_len sweep at block 16\n",
      format_table3(t["table3_kv_sweep"]),
      f"\n## Table 4: wall-clock speedup, block 16, kv_len = {DEFAULT_KV_LEN}, l = 16 / NFE\n",
      format_table4(t["table4"]),
      "",
      explanation(model, device, DEFAULT_KV_LEN),
    ]
  )


def run(out_dir: str | None = None) -> dict[str, list]:
  """Print the tables for the paper's 8B model on the paper's H100 constants; with `out_dir`
  also write roofline.md and results.json there."""
  model, device = paper_8b(), H100_FP8
  t = tables(model, device)
  markdown = format_markdown(model, device, t)
  print(markdown)
  if out_dir:
    results = {
      "model": dataclasses.asdict(model),
      "device": dataclasses.asdict(device),
      **{name: [dataclasses.asdict(r) for r in rows] for name, rows in t.items()},
    }
    report.save(out_dir, "roofline", results, markdown)
  return t


def main(argv):
  del argv
  run(flags.FLAGS.out)


if __name__ == "__main__":
  flags.DEFINE_string("out", None, "Also write roofline.md and results.json here.")
  cli.run(main)
