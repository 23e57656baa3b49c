"""Hugging Face `config.json` <-> `ModelConfig` for Llama-3.x and Qwen-3 decoders.

Reads both RoPE spellings: transformers<5 (`rope_theta` + `rope_scaling`) and transformers>=5
(`rope_parameters`); writes the <5 spelling, which every transformers release still loads.
"""

from __future__ import annotations

from typing import Any

from sbd_jax.model.architectures import ModelConfig, RopeScaling

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
ARCHITECTURES = {LLAMA: "llama", QWEN3: "qwen3"}  # architecture -> model_type
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


class HFConversionError(ValueError):
  """A Hugging Face directory or config this converter cannot handle (one-line message)."""


def architecture_of(hf: dict[str, Any]) -> str:
  """The single supported architecture named by an HF config, else HFConversionError."""
  names = hf.get("architectures") or []
  by_type = {v: k for k, v in ARCHITECTURES.items()}.get(hf.get("model_type", ""))
  arch = names[0] if len(names) == 1 else by_type
  if arch not in ARCHITECTURES:
    raise HFConversionError(
      f"unsupported architecture {names or hf.get('model_type')!r}: only "
      f"{sorted(ARCHITECTURES)} (model_type {sorted(ARCHITECTURES.values())}) convert"
    )
  return arch


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
  """(theta, llama3 scaling or None) from either RoPE spelling."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {}) or params
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise HFConversionError(f"unsupported rope_type {rope_type!r}: only 'default' and 'llama3'")
  return theta, RopeScaling(
    factor=float(scaling["factor"]),
    low_freq_factor=float(scaling["low_freq_factor"]),
    high_freq_factor=float(scaling["high_freq_factor"]),
    original_max_position=int(scaling["original_max_position_embeddings"]),
  )


def hf_dtype(hf: dict[str, Any]) -> str:
  """The checkpoint's stored dtype ("dtype" in transformers>=5, "torch_dtype" before)."""
  return _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), "float32")


def model_config_from_hf(
  hf: dict[str, Any],
  *,
  param_dtype: str | None = None,
  compute_dtype: str | None = None,
  **overrides: Any,
) -> ModelConfig:
  """An HF LlamaForCausalLM / Qwen3ForCausalLM config -> ModelConfig.

  param_dtype defaults to the checkpoint's dtype; compute_dtype to param_dtype.
  """
  arch = architecture_of(hf)
  unsupported = {
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
  }
  for key, expected in unsupported.items():
    if hf.get(key, expected) != expected:
      raise HFConversionError(f"unsupported {key}={hf[key]!r} (expected {expected!r})")
  theta, scaling = _rope(hf)
  heads = int(hf["num_attention_heads"])
  param_dtype = param_dtype or hf_dtype(hf)
  try:
    return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      embed_dim=int(hf["hidden_size"]),
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
      mlp_dim=int(hf["intermediate_size"]),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=float(hf["rms_norm_eps"]),
      qk_norm=arch == QWEN3,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      param_dtype=param_dtype,
      compute_dtype=compute_dtype or param_dtype,
      **overrides,
    )
  except KeyError as e:
    raise HFConversionError(f"config.json lacks the field {e.args[0]!r}") from None


def hf_config_from_model(
  cfg: ModelConfig, *, base: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
  """ModelConfig -> an HF config dict. `base` (e.g. the imported model's original config)
  supplies fields we do not model (max_position_embeddings, token ids, ...); ours win."""
  arch = QWEN3 if cfg.qk_norm else LLAMA
  out = {
    k: v
    for k, v in (base or {}).items()
    if k not in ("rope_parameters", "rope_scaling", "torch_dtype", "transformers_version")
  }
  scaling = cfg.rope_scaling
  default_positions = scaling.original_max_position * int(scaling.factor) if scaling else 32_768
  out.update(
    architectures=[arch],
    model_type=ARCHITECTURES[arch],
    vocab_size=cfg.vocab_size,
    num_hidden_layers=cfg.num_layers,
    hidden_size=cfg.embed_dim,
    num_attention_heads=cfg.num_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    intermediate_size=cfg.mlp_dim,
    rms_norm_eps=cfg.norm_eps,
    rope_theta=cfg.rope_theta,
    tie_word_embeddings=cfg.tie_embeddings,
    hidden_act="silu",
    attention_bias=False,
    dtype=cfg.param_dtype,
    max_position_embeddings=out.get("max_position_embeddings", default_positions),
    rope_scaling=None
    if scaling is None
    else {
      "rope_type": "llama3",
      "factor": scaling.factor,
      "low_freq_factor": scaling.low_freq_factor,
      "high_freq_factor": scaling.high_freq_factor,
      "original_max_position_embeddings": scaling.original_max_position,
    },
  )
  if arch == LLAMA:
    out.setdefault("mlp_bias", False)
  out.update(extra)
  return out
