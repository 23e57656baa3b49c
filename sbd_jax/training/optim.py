"""AdamW with linear warm-up, cosine decay and global-norm clipping (the paper's recipe)."""

from __future__ import annotations

import functools

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


EMBEDDING_TABLE = "table_VD"  # `layers.Embedding`'s parameter


def decay_mask(params, decay_embeddings: bool = True):
  """Weight decay mask: matrices, not RMSNorm scales; with `decay_embeddings` False, not the
  token embedding table either.

  Why the option: decay pulls every embedding row towards zero, and with it the random
  component that tells rows apart, while the gradients of tokens that play the same part
  (configs/tiny.py's verbs of one sign, `finds` and `wins`) push them the same way. Rows of
  one sign can then collapse onto one direction, and a model that must copy such a token from
  its prompt no longer can."""

  def decays(path, p) -> bool:
    names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    return p.ndim > 1 and (decay_embeddings or EMBEDDING_TABLE not in names)

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
  optim_cfg: ml_collections.ConfigDict, total_steps: int, skip_nonfinite_steps: int = 0
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(AdamW chain, its lr schedule). With `skip_nonfinite_steps` > 0 the chain is wrapped in
  `optax.apply_if_finite`: an update whose gradients hold a NaN or Inf leaves the parameters and
  the optimizer moments untouched and is counted in the state (`skipped_updates`)."""
  schedule = learning_rate_schedule(optim_cfg, total_steps)
  adamw = optax.adamw(
    schedule,
    b1=optim_cfg.b1,
    b2=optim_cfg.b2,
    eps=optim_cfg.eps,
    weight_decay=optim_cfg.weight_decay,
    mask=functools.partial(decay_mask, decay_embeddings=optim_cfg.decay_embeddings),
  )
  clip = [optax.clip_by_global_norm(optim_cfg.clip_norm)] if optim_cfg.clip_norm > 0 else []
  tx = optax.chain(*clip, adamw)
  if skip_nonfinite_steps > 0:
    # The host stops the run once more than `skip_nonfinite_steps` updates were skipped; the
    # consecutive limit only bounds the damage if it never hears about them.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=skip_nonfinite_steps)
  return tx, schedule


def skipped_updates(opt_state) -> tuple[jax.Array, jax.Array] | None:
  """(total skipped updates, whether the last one was skipped) from an `apply_if_finite` state,
  or None when the optimizer does not skip."""
  if not isinstance(opt_state, optax.ApplyIfFiniteState):
    return None
  return opt_state.total_notfinite[...], ~opt_state.last_finite[...]
