"""One entry point for every attention implementation: `attend(..., impl=...)`."""

from __future__ import annotations

from sbd_jax.attention.chunked import chunked_attention
from sbd_jax.attention.dense import dense_attention
from sbd_jax.attention.meta import TokenMeta


def attend(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  q_meta: TokenMeta,
  kv_meta: TokenMeta,
  *,
  impl: str = "chunked",
  chunk: int = 512,
):
  """Dispatch to the dense reference or the chunked implementation."""
  if impl == "dense":
    return dense_attention(q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta)
  if impl == "chunked":
    return chunked_attention(q_BTNH, k_BSKH, v_BSKH, q_meta, kv_meta, chunk)
  if impl == "splash":  # training layout only: the keys are the queries' own tokens
    from sbd_jax.attention import splash  # imports Pallas TPU kernels; only when asked for

    return splash.splash_attention(q_BTNH, k_BSKH, v_BSKH, q_meta, tile=chunk)
  raise ValueError(f"unknown attention impl {impl!r}; use 'dense', 'chunked' or 'splash'")
