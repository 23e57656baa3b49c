"""A splash kernel that returns its log-sum-exp too, differentiable in both outputs.

Two attentions over disjoint key sets merge exactly by their log-sum-exps (`block_local.merge`),
so a kernel can leave part of a mask to another op. JAX's splash kernel returns the log-sum-exp
(`save_residuals=True`) but has no gradient for it. With cotangents dO and dlse, the softmax
backward is the usual one with the row term D = rowsum(O * dO) replaced by D - dlse:

  dS = P * (dO V^T - (D - dlse))

so the backward here is splash's own dq and dkv kernels called with that D. They are private
functions of `splash_attention_kernel` (JAX 0.10-0.11); `tests/test_splash.py` checks this
gradient against a dense reference in Pallas interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib


def with_logsumexp(kernel: kernel_lib.SplashAttentionKernel):
  """(q_GTH, k_SH, v_SH, segment_ids) -> (o_GTH, lse_GT) for an MQA splash `kernel` made with
  `save_residuals=True`: o in q's dtype, lse in float32 (natural log, scores already scaled)."""
  if not kernel.kwargs.get("save_residuals"):
    raise ValueError("with_logsumexp needs a splash kernel made with save_residuals=True")
  options = kernel.kwargs
  sizes = options["block_sizes"]
  if sizes.use_fused_bwd_kernel:
    raise ValueError(
      "with_logsumexp runs splash's two-kernel backward (dq, dkv); "
      "make the kernel with use_fused_bwd_kernel=False"
    )

  @jax.custom_vjp
  def attend(q_GTH, k_SH, v_SH, segment_ids):
    o_GTH, (lse_GT,) = kernel(q_GTH, k_SH, v_SH, segment_ids=segment_ids)
    return o_GTH, lse_GT

  def forward(q_GTH, k_SH, v_SH, segment_ids):
    o_GTH, lse_GT = attend(q_GTH, k_SH, v_SH, segment_ids)
    return (o_GTH, lse_GT), (q_GTH, k_SH, v_SH, segment_ids, o_GTH, lse_GT)

  def backward(residuals, cotangents):
    q_GTH, k_SH, v_SH, segment_ids, o_GTH, lse_GT = residuals
    do_GTH, dlse_GT = cotangents
    do_GTH = do_GTH.astype(q_GTH.dtype)
    d_GT = jnp.einsum("GTH,GTH->GT", o_GTH.astype(jnp.float32), do_GTH.astype(jnp.float32))
    d_GT = d_GT - dlse_GT.astype(jnp.float32)
    common = dict(
      is_mqa=options["is_mqa"],
      mask_value=options["mask_value"],
      attn_logits_soft_cap=options["attn_logits_soft_cap"],
      q_layout=sizes.q_layout,
      k_layout=sizes.k_layout,
      v_layout=sizes.v_layout,
      mask_function=options["mask_function"],
      interpret=options["interpret"],
    )
    args = (q_GTH, k_SH, v_SH, segment_ids, None, lse_GT, do_GTH, d_GT)
    _, dk_SH, dv_SH = kernel_lib._splash_attention_bwd_dkv(
      *args,
      bq=sizes.block_q_dkv,
      bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute,
      mask_info=_collapsed(kernel.dkv_mask_info),
      use_fused_bwd_kernel=False,
      **common,
    )
    dq_GTH = kernel_lib._splash_attention_bwd_dq(
      *args,
      bq=sizes.block_q_dq,
      bkv=sizes.block_kv_dq,
      mask_info=_collapsed(kernel.dq_mask_info),
      **common,
    )
    return dq_GTH, dk_SH, dv_SH, None

  attend.defvjp(forward, backward)
  return attend


def _collapsed(mask_info):
  """A MaskInfo as the kernels take it (what `splash_attention_kernel._splash_attention` does
  before calling them): partial mask blocks with their leading axes flattened."""
  if mask_info.partial_mask_blocks is None:
    return mask_info
  blocks = mask_info.partial_mask_blocks
  return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))
