"""Hugging Face directory -> sbd_jax workdir (`config.json` + `params/` + tokenizer files).

Tensors stream one at a time from the safetensors files (`safe_open`) and are placed straight
onto their shards (`jax.make_array_from_callback` with the NamedSharding that `state_shardings`
derives from the abstract model), so the host never holds more than the model once plus one
tensor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sbd_jax import config as config_lib
from sbd_jax import paths, sharding
from sbd_jax.data.chat import TEMPLATE_FILE as CHAT_TEMPLATE_FILE
from sbd_jax.data.tokenizer import TOKENIZER_FILE, TOKENIZER_SIDECARS, HFTokenizer, TokenizerError
from sbd_jax.hf import param_map
from sbd_jax.hf.config_map import HFConversionError, model_config_from_hf
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.model.transformer import Transformer
from sbd_jax.run import checkpointing
from sbd_jax.run import workdir as workdir_lib

log = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
HF_CONFIG_COPY = "hf_config.json"  # the source config.json, kept for a faithful export
HF_GENERATION_COPY = "hf_generation_config.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def read_hf_config(hf_dir: str) -> dict[str, Any]:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise HFConversionError(f"no config.json in {hf_dir!r}: is it a Hugging Face model directory?")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def weight_files(hf_dir: str) -> dict[str, str]:
  """HF tensor name -> safetensors file path (single file or sharded with an index)."""
  index = os.path.join(hf_dir, SAFETENSORS_INDEX)
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
  single = os.path.join(hf_dir, SAFETENSORS_FILE)
  if not os.path.isfile(single):
    raise HFConversionError(
      f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {hf_dir!r} "
      "(PyTorch .bin checkpoints are not supported; re-save with "
      "safe_serialization=True)"
    )
  from safetensors import safe_open

  with safe_open(single, framework="np") as f:
    return {name: single for name in f.keys()}


def abstract_params(
  cfg: ModelConfig, mesh: Mesh | None = None, rules: sharding.Rules = sharding.PARAM_RULES
) -> nnx.State:
  """The model's Param state as ShapeDtypeStructs (with NamedShardings when a mesh is given)."""
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  if mesh is None:
    return abstract
  shardings = sharding.state_shardings(abstract, mesh, rules)
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )


def _place(array: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
  target_sharding = getattr(target, "sharding", None)
  if target_sharding is None:
    return jax.device_put(array)
  return jax.make_array_from_callback(array.shape, target_sharding, lambda index: array[index])


def load_hf_params(
  hf_dir: str,
  cfg: ModelConfig,
  mesh: Mesh | None = None,
  rules: sharding.Rules = sharding.PARAM_RULES,
) -> nnx.State:
  """Stream the safetensors of `hf_dir` into an nnx Param state laid out for `cfg` (and mesh)."""
  from safetensors import safe_open

  files = weight_files(hf_dir)
  abstract = abstract_params(cfg, mesh, rules)
  targets = nnx.to_pure_dict(abstract)
  entries = list(param_map.entries(cfg))
  expected = {name for name, _, _ in entries}
  missing = sorted(expected - files.keys())
  if missing:
    raise HFConversionError(
      f"{len(missing)} tensors missing from the safetensors of {hf_dir!r}, e.g. {missing[:3]}"
    )
  ignorable = lambda n: (
    n.endswith(IGNORED_SUFFIXES)
    or (  # noqa: E731
      n == "lm_head.weight" and cfg.tie_embeddings
    )
  )
  unexpected = sorted(n for n in files.keys() - expected if not ignorable(n))
  if unexpected:
    raise HFConversionError(
      f"{len(unexpected)} unsupported tensors in {hf_dir!r}, "
      f"e.g. {unexpected[:3]} (biases or extra modules are not supported)"
    )

  # One target array at a time: a single tensor, or with scan_layers the num_layers tensors
  # stacked into one array (the host then holds one stacked parameter, e.g. 32 MLP matrices).
  groups: dict[param_map.Path, list[tuple[str, int | None, param_map.Transform]]] = {}
  for hf_name, path, transform in entries:
    stored, layer = param_map.stored_at(cfg, path)
    groups.setdefault(stored, []).append((hf_name, layer, transform))
  pure: dict = jax.tree.map(lambda x: None, targets)
  with contextlib.ExitStack() as stack:
    handles: dict[str, Any] = {}

    def read(hf_name: str, transform: param_map.Transform, shape) -> np.ndarray:
      file = files[hf_name]
      if file not in handles:
        handles[file] = stack.enter_context(safe_open(file, framework="np"))
      return transform.to_ours(handles[file].get_tensor(hf_name), tuple(shape))

    for stored, members in groups.items():
      target = param_map.get_path(targets, stored)
      if members[0][1] is None:
        ((hf_name, _, transform),) = members
        array = read(hf_name, transform, target.shape)
      else:
        array = np.stack([read(name, tf, target.shape[1:]) for name, _, tf in members])
      param_map.set_path(pure, stored, _place(array.astype(target.dtype, copy=False), target))
      del array
  params = jax.tree.map(lambda x: x, abstract)
  nnx.replace_by_pure_dict(params, pure)
  return params


def _copy_tokenizer_files(src_dir: str, out: str) -> None:
  """The tokenizer, its special-token files and its chat template (`sbd_jax.data.chat`)."""
  for name in (TOKENIZER_FILE, *TOKENIZER_SIDECARS, CHAT_TEMPLATE_FILE):
    if os.path.isfile(os.path.join(src_dir, name)):
      shutil.copyfile(os.path.join(src_dir, name), os.path.join(out, name))


def converted_config(
  model_cfg: ModelConfig, out: str, tokenizer: HFTokenizer
) -> ml_collections.ConfigDict:
  """The experiment config written to <out>/config.json: fine-tunable and samplable as is."""
  c = config_lib.base_config(model_cfg)
  c.tokenizer = os.path.join(out, TOKENIZER_FILE)
  c.sbd.mask_id = tokenizer.mask_id
  c.train.init_from = os.path.join(out, checkpointing.PARAMS_DIR)
  c.data.source = "jsonl"
  return c


def import_hf(
  hf_dir: str,
  out: str,
  *,
  mask_token: str | None = None,
  dtype: str | None = None,
  mesh: Mesh | None = None,
  rules: sharding.Rules = sharding.PARAM_RULES,
  **model_overrides: Any,
) -> ml_collections.ConfigDict:
  """Convert an HF Llama-3.x / Qwen-3 directory into an sbd_jax workdir at `out`.

  `dtype` sets param and compute dtype (default: the checkpoint's). Returns the written config.
  """
  for name, path in (("hf_dir", hf_dir), ("out", out)):
    if paths.is_remote(path):
      raise HFConversionError(f"{name}={path}: conversion reads and writes local directories")
  hf_dir, out = os.path.abspath(hf_dir), os.path.abspath(out)
  if not os.path.isdir(hf_dir):
    raise HFConversionError(f"{hf_dir!r} is not a directory")
  hf = read_hf_config(hf_dir)
  model_cfg = model_config_from_hf(hf, param_dtype=dtype, compute_dtype=dtype, **model_overrides)
  tokenizer = HFTokenizer.from_path(
    hf_dir, mask_token=mask_token, model_vocab_size=model_cfg.vocab_size
  )
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise TokenizerError(
      f"tokenizer vocabulary ({tokenizer.vocab_size}) exceeds the model's ({model_cfg.vocab_size})"
    )
  files = weight_files(hf_dir)  # fail on missing weights before any work
  del files
  log.info("importing %s (%s) mask=%d", hf_dir, model_cfg, tokenizer.mask_id)
  params = load_hf_params(hf_dir, model_cfg, mesh, rules)

  os.makedirs(out, exist_ok=True)
  _copy_tokenizer_files(hf_dir, out)
  shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(out, HF_CONFIG_COPY))
  if os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
    shutil.copyfile(
      os.path.join(hf_dir, "generation_config.json"), os.path.join(out, HF_GENERATION_COPY)
    )
  c = converted_config(model_cfg, out, tokenizer)
  if jax.process_index() == 0:
    workdir_lib.write_config(out, c)
  checkpointing.export_params(out, params)
  return c


def finetune_config(converted_dir: str) -> ml_collections.ConfigDict:
  """A fresh base config whose model fields, tokenizer, mask id and init_from come from a
  converted workdir's config.json (so no model field is copied by hand)."""
  converted = workdir_lib.read_config(converted_dir)
  c = config_lib.base_config(config_lib.to_model_config(converted))
  c.tokenizer = converted.tokenizer
  c.sbd.mask_id = converted.sbd.mask_id
  c.train.init_from = str(paths.resolve(converted_dir) / checkpointing.PARAMS_DIR)
  c.data.source = "jsonl"
  return c
