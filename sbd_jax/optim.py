"""AdamW with linear warm-up, cosine decay and global-norm clipping (the paper's recipe)."""

from __future__ import annotations

import jax
import ml_collections
import optax


def learning_rate_schedule(
  optim_cfg: ml_collections.ConfigDict, total_steps: int
) -> optax.Schedule:
  decay_steps = optim_cfg.decay_steps
  if decay_steps < 0:
    decay_steps = max(1, total_steps - optim_cfg.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=optim_cfg.lr,
    warmup_steps=optim_cfg.warmup_steps,
    decay_steps=optim_cfg.warmup_steps + decay_steps,
    end_value=optim_cfg.lr * optim_cfg.end_lr_ratio,
  )


def _matrices_only(params):
  """Weight decay mask: decay matrices, not RMSNorm scales."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(
  optim_cfg: ml_collections.ConfigDict, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(optim_cfg, total_steps)
  adamw = optax.adamw(
    schedule,
    b1=optim_cfg.b1,
    b2=optim_cfg.b2,
    eps=optim_cfg.eps,
    weight_decay=optim_cfg.weight_decay,
    mask=_matrices_only,
  )
  clip = [optax.clip_by_global_norm(optim_cfg.clip_norm)] if optim_cfg.clip_norm > 0 else []
  return optax.chain(*clip, adamw), schedule
