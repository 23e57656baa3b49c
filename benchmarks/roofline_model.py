"""Roofline estimate of SBD wall-clock speedups (paper section 4).

The cost model: every per-layer matmul and the fused attention are costed as
max(FLOPs / peak, bytes / bandwidth); a forward over n new tokens in each of B sequences is the
sum over layers. `roofline` lays out the paper's Tables 3 and 4 from it.

Dimension letters: B batch, n new tokens per sequence, S cached tokens (kv_len), D hidden,
N query heads, K KV heads, H head dim, F MLP width, V vocab; T = B * n rows of every matmul.

Choices (all parameters, with these defaults):

* Units. Peaks are FLOP/s, bandwidth is bytes/s. The H100 preset uses the paper's constants
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

The paper's printed code uses K/V projections [D, N * K] and FFN
matrices [D, D * ffn]. `paper_shapes=True` reproduces those shapes, with `ffn` = the FFN width
F (= 16384): with that reading the FFN matrices (4096 x 67M, 275 GB each) dwarf everything, every
term is memory-bound and the slowdown is (1 + B * k / D) / (1 + B / D) -- 1.0037, 1.0292,
1.0584 at B = 1, 8, 16, k = 16, i.e. the printed 1.004 / 1.029 / 1.058, and 3.98x for Table 4.
"""

from __future__ import annotations

import dataclasses

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


# The paper's constants (section 4): FP8 matmuls, BF16 attention, 3.35 TiB/s.
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
