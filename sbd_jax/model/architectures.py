"""Architecture presets: one frozen config covers Llama-3.x and Qwen-3 decoders.

The presets follow the public model cards (Llama-3.1 8B, Qwen-3 8B, Llama-3.2 1B) and the paper's
3B ablation model (28 layers, width 3072).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 "llama3" RoPE frequency scaling (long-context extension)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


REMAT_CHOICES = ("none", "full", "dots", "dots_no_batch", "offload")
ATTENTION_IMPLS = ("chunked", "dense", "splash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer: GQA, RoPE, RMSNorm, SwiGLU, optional QK-norm."""

  vocab_size: int
  num_layers: int
  embed_dim: int  # D
  num_heads: int  # N
  num_kv_heads: int  # K
  head_dim: int  # H, not assumed to be D // N (Qwen-3 small sizes differ)
  mlp_dim: int  # F
  rope_theta: float = 500_000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-5
  qk_norm: bool = False
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # Recompute each layer in the backward pass: "none", "full" (keep only the layer's input),
  # "dots" (keep matmul outputs) or "dots_no_batch" (keep weight matmuls, recompute attention).
  remat: str = "none"
  # Stack the layers' parameters on a leading axis and run them with lax.scan: one compiled
  # layer body instead of num_layers (compile time and program size at 8B).
  scan_layers: bool = False
  # "chunked" (memory-efficient, any device), "dense" (reference) or "splash" (Pallas TPU
  # kernels for training; needs sbd.block_anchor="row"; forwards with a KV cache use chunked).
  attention_impl: str = "chunked"
  attention_chunk: int = 512  # query/key chunk of the chunked kernel; splash's tile

  def __post_init__(self):
    checks = {
      f"remat must be one of {REMAT_CHOICES}": self.remat in REMAT_CHOICES,
      "num_heads must be a multiple of num_kv_heads": self.num_heads % self.num_kv_heads == 0,
      "head_dim must be even (RoPE rotates pairs)": self.head_dim % 2 == 0,
      f"attention_impl must be one of {ATTENTION_IMPLS}": self.attention_impl in ATTENTION_IMPLS,
      "all sizes must be positive": min(
        self.vocab_size,
        self.num_layers,
        self.embed_dim,
        self.num_heads,
        self.head_dim,
        self.mlp_dim,
        self.attention_chunk,
      )
      > 0,
    }
    for message, ok in checks.items():
      if not ok:
        raise ValueError(f"ModelConfig: {message}")
    for name in ("param_dtype", "compute_dtype"):
      jnp.dtype(getattr(self, name))  # raises TypeError on a typo

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def for_decoding(self) -> "ModelConfig":
    """The same model as decoding holds it: parameters stored in the compute dtype (a forward
    casts every matmul weight to it anyway, so float32 master weights would only double the
    bytes each memory-bound decode step reads; RMSNorm scales are rounded to it too) and the
    layers unrolled (a forward updates each layer's KV cache in place, which a scan would
    return as fresh stacked buffers). Parameter checkpoints load into it in either layout."""
    return self.replace(param_dtype=self.compute_dtype, scan_layers=False)


def llama3_1_8b(**overrides: Any) -> ModelConfig:
  """Llama-3.1 8B: 32 layers, D=4096, 32/8 heads, F=14336, llama3 RoPE scaling."""
  cfg = ModelConfig(
    vocab_size=128_256,
    num_layers=32,
    embed_dim=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=14_336,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(),
    norm_eps=1e-5,
    qk_norm=False,
    tie_embeddings=False,
    param_dtype="float32",  # master weights and Adam moments; bf16 would round away updates
    compute_dtype="bfloat16",
    remat="full",
    scan_layers=True,
    attention_impl="splash",  # TPU training; needs sbd.block_anchor="row"
  )
  return cfg.replace(**overrides)


def qwen3_8b(**overrides: Any) -> ModelConfig:
  """Qwen-3 8B: 36 layers, D=4096, 32/8 heads, F=12288, per-head QK RMSNorm."""
  cfg = ModelConfig(
    vocab_size=151_936,
    num_layers=36,
    embed_dim=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=12_288,
    rope_theta=1_000_000.0,
    rope_scaling=None,
    norm_eps=1e-6,
    qk_norm=True,
    tie_embeddings=False,
    param_dtype="float32",  # master weights and Adam moments; bf16 would round away updates
    compute_dtype="bfloat16",
    remat="full",
    scan_layers=True,
    attention_impl="splash",  # TPU training; needs sbd.block_anchor="row"
  )
  return cfg.replace(**overrides)


def llama3_2_1b(**overrides: Any) -> ModelConfig:
  """Llama-3.2 1B: 16 layers, D=2048, 32/8 heads of 64, F=8192; otherwise the Llama-3.2 family
  of `ablation_3b` (vocabulary, tied embeddings, llama3 RoPE scaling by 32). Chunked attention:
  a one-GPU model (splash is TPU-only)."""
  cfg = ablation_3b(
    num_layers=16,
    embed_dim=2048,
    num_heads=32,
    head_dim=64,
    mlp_dim=8192,
    remat="none",
    attention_impl="chunked",
    attention_chunk=1024,
  )
  return cfg.replace(**overrides)


def ablation_3b(**overrides: Any) -> ModelConfig:
  """The paper's 3B ablation model: 28 layers, width 3072 (Llama-3.2 3B shapes).

  The paper gives only depth and width; heads, MLP and vocabulary follow Llama-3.2 3B,
  the public Llama model of that depth and width.
  """
  cfg = ModelConfig(
    vocab_size=128_256,
    num_layers=28,
    embed_dim=3072,
    num_heads=24,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=8192,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(factor=32.0),
    norm_eps=1e-5,
    tie_embeddings=True,
    param_dtype="float32",  # master weights and Adam moments; bf16 would round away updates
    compute_dtype="bfloat16",
    remat="full",
    scan_layers=True,
    attention_impl="splash",  # TPU training; needs sbd.block_anchor="row"
  )
  return cfg.replace(**overrides)


def tiny(**overrides: Any) -> ModelConfig:
  """A ~1M-parameter model for the CPU: byte vocabulary plus specials."""
  cfg = ModelConfig(
    vocab_size=260,
    num_layers=4,
    embed_dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=384,
    rope_theta=10_000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
    attention_chunk=128,
  )
  return cfg.replace(**overrides)
