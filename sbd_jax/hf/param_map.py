"""The ONE Hugging Face <-> sbd_jax parameter table, used by both import and export.

Each row: (HF tensor name, our param path, transform). `{i}` stands for the layer index; with
`scan_layers` the per-layer paths name rows of the stacked arrays (see `stored_at`).
HF linear weights are [out, in]; ours put the input dims first and split heads:
q_proj [N*H, D] <-> q_DNH [D, N, H], o_proj [D, N*H] <-> o_NHD [N, H, D]. RoPE is rotate-half
in both codebases, so q/k weights need no permutation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import numpy as np

from sbd_jax.model.architectures import ModelConfig

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
  """HF tensor <-> our array. `linear_in_dims` = 0: same layout; k > 0: an HF [out, in] linear
  weight whose input is our first k dims (ours = hf.T reshaped to our shape)."""

  linear_in_dims: int = 0

  def to_ours(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = hf.T if self.linear_in_dims else hf
    if out.size != math.prod(shape):
      raise ValueError(f"HF tensor of shape {hf.shape} cannot become {shape}")
    return np.ascontiguousarray(out.reshape(shape))

  def to_hf(self, ours: np.ndarray) -> np.ndarray:
    if not self.linear_in_dims:
      return np.ascontiguousarray(ours)
    fan_in = math.prod(ours.shape[: self.linear_in_dims])
    return np.ascontiguousarray(ours.reshape(fan_in, -1).T)


SAME = Transform(0)
LINEAR = Transform(1)  # [out, in] <-> [in, out...]
LINEAR_FROM_HEADS = Transform(2)  # o_proj [D, N*H] <-> o_NHD [N, H, D]

# (HF name, our path, transform, present when). `when` is a ModelConfig predicate name or None.
PARAM_TABLE: tuple[tuple[str, str, Transform, str | None], ...] = (
  ("model.embed_tokens.weight", "embed.table_VD", SAME, None),
  ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attention_norm.scale", SAME, None),
  ("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attention.q_DNH", LINEAR, None),
  ("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attention.k_DKH", LINEAR, None),
  ("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attention.v_DKH", LINEAR, None),
  (
    "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attention.o_NHD",
    LINEAR_FROM_HEADS,
    None,
  ),
  (
    "model.layers.{i}.self_attn.q_norm.weight",
    "blocks.{i}.attention.q_norm.scale",
    SAME,
    "qk_norm",
  ),
  (
    "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.attention.k_norm.scale",
    SAME,
    "qk_norm",
  ),
  ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm.scale", SAME, None),
  ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.gate_DF", LINEAR, None),
  ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.up_DF", LINEAR, None),
  ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.down_FD", LINEAR, None),
  ("model.norm.weight", "final_norm.scale", SAME, None),
  ("lm_head.weight", "lm_head_DV", LINEAR, "untied"),
)


def _present(cfg: ModelConfig, when: str | None) -> bool:
  return (
    when is None
    or (when == "untied" and not cfg.tie_embeddings)
    or (when != "untied" and bool(getattr(cfg, when)))
  )


def _parse_path(path: str) -> Path:
  return tuple(int(p) if p.isdigit() else p for p in path.split("."))


def entries(cfg: ModelConfig) -> Iterator[tuple[str, Path, Transform]]:
  """Every (HF name, our path, transform) of a model, layers expanded, in HF order."""
  for hf_name, our_path, transform, when in PARAM_TABLE:
    if not _present(cfg, when):
      continue
    layers = range(cfg.num_layers) if "{i}" in hf_name else [None]
    for i in layers:
      fmt = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)  # noqa: E731
      yield fmt(hf_name), _parse_path(fmt(our_path)), transform


def stored_at(cfg: ModelConfig, path: Path) -> tuple[Path, int | None]:
  """Where an (unrolled) parameter path lives in `cfg`'s tree: (path, layer index) when the
  layers are stacked for scan (blocks.{i}.x -> row i of blocks.x), else (path, None)."""
  if cfg.scan_layers and path[0] == "blocks":
    return ("blocks", *path[2:]), path[1]
  return path, None


def get_path(tree: dict, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def set_path(tree: dict, path: Path, value) -> None:
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value
