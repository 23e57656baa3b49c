"""Roofline estimate of SBD wall-clock speedups (paper section 4, Tables 3 and 4).

Every per-layer matmul and the fused attention are costed as max(FLOPs / peak, bytes / bandwidth);
a forward over n new tokens in each of B sequences is the sum over layers. Run
`python -m sbd_jax.benchmarks.roofline` to print both tables next to the paper's numbers.

Dimension letters: B batch, n new tokens per sequence, S cached tokens (kv_len), D hidden,
N query heads, K KV heads, H head dim, F MLP width, V vocab; T = B * n rows of every matmul.

Choices (all parameters, with these defaults):

* Units. Peaks are FLOP/s, bandwidth is bytes/s. The H100 preset uses the brief's constants
  verbatim: 1978 TFLOP/s (1e12) FP8 matmul, 989 TFLOP/s BF16 attention, 3.35 TiB/s = 3.35 * 2**40
  bytes/s. (NVIDIA's datasheet says 3.35 TB/s = 3.35e12; the 10% difference only moves where
  matmuls turn compute-bound, not any memory-bound ratio.)
* "FFN 4x" is read as a SwiGLU MLP (gate, up [D, F], down [F, D]) with F = 4 * D = 16384, since
  the paper's 8B models are Llama-3.1 / Qwen-3, both SwiGLU. `mlp="dense"` gives the classic
  2-matrix MLP; `llama3_1_8b()` gives the real Llama width F = 14336.
* Activations are 1 byte (FP8 GEMM inputs/outputs, `bytes_per_activation`); with 1-byte
  activations the paper's printed shapes reproduce its printed numbers exactly (see below).
* Only the transformer layers are costed (as in the paper); `include_lm_head=True` adds the
  embedding gather and the [D, V] logits matmul for every new token.
* Attention: each of the n new queries reads all S + n keys/values (no causal-tile skipping);
  FLOPs = 4 * B * n * (S + n) * N * H (QK^T and PV, softmax ignored); bytes = K/V of S + n tokens
  + q read + o written.
* KV length for the tables: 1024 cached tokens by default (a short prompt). Attention on the
  cache is memory-bound and identical for n = 1 and n = k, so a long cache only dilutes the
  slowdown; a short cache is therefore close to the worst case, matching the paper's
  "at most" wording. Table 3 also prints a sweep over kv_len.

The paper's printed code (as the brief reports it) uses K/V projections [D, N * K] and FFN
matrices [D, D * ffn]. `paper_shapes=True` reproduces those shapes, with `ffn` = the FFN width
F (= 16384): with that reading the FFN matrices (4096 x 67M, 275 GB each) dwarf everything, every
term is memory-bound and the slowdown is (1 + B * k / D) / (1 + B / D) -- 1.0037, 1.0292,
1.0584 at B = 1, 8, 16, k = 16, i.e. the printed 1.004 / 1.029 / 1.058, and 3.98x for Table 4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sbd_jax.benchmarks import markdown
from sbd_jax.model import architectures

TIB = 2.0**40  # bytes in a tebibyte
TERA = 1e12

# ---------------------------------------------------------------------------------------------
# Hardware and model descriptions.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Device:
  """Accelerator peaks: FLOP/s for matmuls and for attention, HBM bandwidth in bytes/s."""

  name: str
  peak_matmul_flops: float
  peak_attention_flops: float
  bandwidth_bytes_per_s: float

  @classmethod
  def from_peaks(
    cls,
    name: str,
    peak_flops: float,
    bandwidth_bytes_per_s: float,
    peak_attention_flops: float | None = None,
  ) -> Device:
    """Any device from its peak FLOP/s and bandwidth; attention peak defaults to the matmul one."""
    attn = peak_flops if peak_attention_flops is None else peak_attention_flops
    return cls(name, float(peak_flops), float(attn), float(bandwidth_bytes_per_s))


# The paper's constants (brief section 4): FP8 matmuls, BF16 attention, 3.35 TiB/s.
H100_FP8 = Device(
  name="H100 (FP8 matmul 1978 TFLOP/s, BF16 attention 989 TFLOP/s, 3.35 TiB/s)",
  peak_matmul_flops=1978 * TERA,
  peak_attention_flops=989 * TERA,
  bandwidth_bytes_per_s=3.35 * TIB,
)


@dataclasses.dataclass(frozen=True)
class Model:
  """Decoder shapes and storage widths; `mlp` is "swiglu" (gate, up, down) or "dense" (up, down)."""

  name: str
  hidden: int  # D
  ffn_size: int  # F
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H
  num_layers: int
  bytes_per_weight: float = 1.0
  bytes_per_kv: float = 1.0
  bytes_per_activation: float = 1.0
  mlp: str = "swiglu"
  vocab_size: int = 128256  # V, only used with include_lm_head=True

  def __post_init__(self):
    if self.mlp not in ("swiglu", "dense"):
      raise ValueError(f"mlp must be 'swiglu' or 'dense', got {self.mlp!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError("num_heads must be a multiple of num_kv_heads")

  @property
  def ffn_multiplier(self) -> float:
    return self.ffn_size / self.hidden

  @classmethod
  def from_config(cls, cfg: architectures.ModelConfig, name: str, **storage) -> Model:
    """The shapes of a project model config (e.g. an architectures preset)."""
    return cls(
      name=name,
      hidden=cfg.embed_dim,
      ffn_size=cfg.mlp_dim,
      num_heads=cfg.num_heads,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      num_layers=cfg.num_layers,
      vocab_size=cfg.vocab_size,
      **storage,
    )

  @classmethod
  def from_ffn_multiplier(cls, *, hidden: int, ffn_multiplier: float, **kwargs) -> Model:
    """Same as the constructor, with F given as a multiple of D."""
    return cls(hidden=hidden, ffn_size=round(hidden * ffn_multiplier), **kwargs)


def paper_8b(mlp: str = "swiglu", **overrides) -> Model:
  """The paper's roofline 8B model: D 4096, FFN 4x, 32 heads, 8 KV heads, FP8 weights and KV."""
  kwargs = dict(
    name=f"8B (paper: D 4096, FFN 4x {mlp}, 32/8 heads, 32 layers, FP8)",
    hidden=4096,
    ffn_multiplier=4.0,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    num_layers=32,
    mlp=mlp,
  )
  kwargs.update(overrides)
  return Model.from_ffn_multiplier(**kwargs)


def llama3_1_8b(**overrides) -> Model:
  """Llama-3.1 8B's real shapes (the project's preset: SwiGLU F = 14336), FP8 weights and KV."""
  model = Model.from_config(architectures.llama3_1_8b(), "Llama-3.1 8B (F 14336 SwiGLU, FP8)")
  return dataclasses.replace(model, **overrides)


# ---------------------------------------------------------------------------------------------
# Per-op roofline costs.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpCost:
  """One op's roofline: FLOPs, bytes moved, and the resulting time in seconds."""

  name: str
  flops: float
  bytes: float
  time_s: float
  compute_bound: bool


def matmul_cost(
  name: str, tokens: int, d_in: int, d_out: int, model: Model, device: Device
) -> OpCost:
  """[T, d_in] @ [d_in, d_out]: 2 T d_in d_out FLOPs; weights + input + output bytes."""
  flops = 2.0 * tokens * d_in * d_out
  nbytes = (
    d_in * d_out * model.bytes_per_weight + tokens * (d_in + d_out) * model.bytes_per_activation
  )
  t_compute = flops / device.peak_matmul_flops
  t_memory = nbytes / device.bandwidth_bytes_per_s
  return OpCost(name, flops, nbytes, max(t_compute, t_memory), t_compute > t_memory)


def layer_matmul_shapes(model: Model, paper_shapes: bool = False) -> list[tuple[str, int, int]]:
  """(name, d_in, d_out) of every matmul in one layer; `paper_shapes` uses the printed ones."""
  D, F, N, K, H = model.hidden, model.ffn_size, model.num_heads, model.num_kv_heads, model.head_dim
  kv_out = N * K if paper_shapes else K * H  # paper: heads * kv_heads; correct: kv_heads * head_dim
  ffn = D * F if paper_shapes else F  # paper: [hidden, hidden * ffn]; correct: [hidden, ffn]
  shapes = [
    ("q_proj", D, N * H),
    ("k_proj", D, kv_out),
    ("v_proj", D, kv_out),
    ("o_proj", N * H, D),
  ]
  if model.mlp == "swiglu":
    shapes += [("gate_proj", D, ffn), ("up_proj", D, ffn)]
  else:
    shapes += [("up_proj", D, ffn)]
  shapes += [("down_proj", ffn, D)]
  return shapes


def attention_cost(model: Model, device: Device, batch: int, n: int, kv_len: int) -> OpCost:
  """Fused attention of n new queries per sequence over kv_len cached + n new keys/values."""
  N, K, H = model.num_heads, model.num_kv_heads, model.head_dim
  keys = kv_len + n
  flops = 4.0 * batch * n * keys * N * H
  kv_bytes = batch * keys * 2 * K * H * model.bytes_per_kv
  qo_bytes = batch * n * 2 * N * H * model.bytes_per_activation
  nbytes = kv_bytes + qo_bytes
  t_compute = flops / device.peak_attention_flops
  t_memory = nbytes / device.bandwidth_bytes_per_s
  return OpCost("attention", flops, nbytes, max(t_compute, t_memory), t_compute > t_memory)


def forward_costs(
  model: Model,
  device: Device,
  batch: int,
  n: int,
  kv_len: int,
  *,
  paper_shapes: bool = False,
  include_lm_head: bool = False,
) -> list[OpCost]:
  """Per-op costs of ONE layer (plus, if asked, the embedding gather and LM head, once)."""
  if batch < 1 or n < 1 or kv_len < 0:
    raise ValueError(f"need batch >= 1, n >= 1, kv_len >= 0; got {batch}, {n}, {kv_len}")
  tokens = batch * n
  costs = [
    matmul_cost(name, tokens, d_in, d_out, model, device)
    for name, d_in, d_out in layer_matmul_shapes(model, paper_shapes)
  ]
  costs.append(attention_cost(model, device, batch, n, kv_len))
  if include_lm_head:
    gather = tokens * model.hidden * model.bytes_per_weight
    costs.append(OpCost("embed", 0.0, gather, gather / device.bandwidth_bytes_per_s, False))
    costs.append(matmul_cost("lm_head", tokens, model.hidden, model.vocab_size, model, device))
  return costs


def forward_time(
  model: Model,
  device: Device,
  batch: int,
  n: int,
  kv_len: int,
  *,
  paper_shapes: bool = False,
  include_lm_head: bool = False,
) -> float:
  """Seconds for one forward over n new tokens in each of `batch` sequences with a KV cache."""
  costs = forward_costs(
    model, device, batch, n, kv_len, paper_shapes=paper_shapes, include_lm_head=include_lm_head
  )
  per_layer = sum(c.time_s for c in costs if c.name not in ("embed", "lm_head"))
  once = sum(c.time_s for c in costs if c.name in ("embed", "lm_head"))
  return model.num_layers * per_layer + once


# ---------------------------------------------------------------------------------------------
# The paper's two derived quantities.
# ---------------------------------------------------------------------------------------------


def block_slowdown(
  model: Model, device: Device, batch: int, block_size: int, kv_len: int, **kwargs
) -> float:
  """time(n = block_size) / time(n = 1): the paper's Table 3."""
  t_block = forward_time(model, device, batch, block_size, kv_len, **kwargs)
  return t_block / forward_time(model, device, batch, 1, kv_len, **kwargs)


def wallclock_speedup(
  model: Model,
  device: Device,
  batch: int,
  block_size: int,
  nfe_per_block: float,
  kv_len: int,
  **kwargs,
) -> float:
  """k time(1) / (time(2k) + (l - 1) time(k)): k tokens revealed in l forwards (Table 4).

  The first forward of a block also writes the previous block's k tokens to the cache, so it
  processes 2k tokens; the other l - 1 process the k block tokens. `nfe_per_block` may be a
  non-integer average. Steady state: the first block of a decode (no previous block) is ignored.
  """
  k, l = block_size, nfe_per_block
  if l < 1 or l > k:
    raise ValueError(f"need 1 <= nfe_per_block <= block_size, got l={l}, k={k}")
  t1 = forward_time(model, device, batch, 1, kv_len, **kwargs)
  t_k = forward_time(model, device, batch, k, kv_len, **kwargs)
  t_2k = forward_time(model, device, batch, 2 * k, kv_len, **kwargs)
  return k * t1 / (t_2k + (l - 1) * t_k)


def wallclock_speedup_from_nfe(
  model: Model,
  device: Device,
  batch: int,
  block_size: int,
  nfe_speedup: float,
  kv_len: int,
  **kwargs,
) -> float:
  """Same as `wallclock_speedup` with an NFE speedup s = k / l, i.e. l = k / s.

  Dividing through by time(1): speedup = s / ((s / k) r(2k) + (1 - s / k) r(k)), with
  r(n) = time(n) / time(1) = block_slowdown(n), so s is an upper bound reached when r = 1.
  """
  return wallclock_speedup(
    model, device, batch, block_size, block_size / nfe_speedup, kv_len, **kwargs
  )


# ---------------------------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------------------------

DEFAULT_KV_LEN = 1024
BATCH_SIZES = (1, 8, 16, 32, 64)
BLOCK_SIZES = (2, 4, 8, 16, 32)
KV_LENS = (0, 1024, 4096, 32768)
NFE_SPEEDUPS = (2.0, 3.0, 4.0, 5.0)

# Values the paper prints (brief section 4), keyed as below.
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


# ---------------------------------------------------------------------------------------------
# Printing.
# ---------------------------------------------------------------------------------------------


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
  return markdown.table(header, body)


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
  return markdown.table(header, body)


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


def main() -> None:
  """Print Tables 3 and 4 for the paper's 8B model on the paper's H100 constants."""
  model, device = paper_8b(), H100_FP8
  print(f"# SBD roofline: {model.name}\n# on {device.name}")
  print("# layers only (no LM head / embedding), 1-byte activations, SwiGLU MLP.\n")
  print(f"## Table 3: time(block of k) / time(1 token), kv_len = {DEFAULT_KV_LEN}\n")
  print(format_table3(table3(model, device)))
  print("\n## Table 3, kv_len sweep at block 16\n")
  sweep = table3(model, device, batch_sizes=(1, 8, 16, 64), block_sizes=(16,), kv_lens=KV_LENS)
  print(format_table3(sweep))
  print(f"\n## Table 4: wall-clock speedup, block 16, kv_len = {DEFAULT_KV_LEN}, l = 16 / NFE\n")
  print(format_table4(table4(model, device)))
  print()
  print(explanation(model, device, DEFAULT_KV_LEN))


if __name__ == "__main__":
  main()
