"""sbd_jax workdir -> Hugging Face directory that `transformers` loads with `from_pretrained`.

Writes `model*.safetensors` (sharded past `max_shard_bytes`, with an index), `config.json`
(recording `sbd_mask_token_id`), `generation_config.json` and the tokenizer files. Parameters
are gathered to the host one tensor at a time and written shard by shard.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import nnx

from sbd_jax import config as config_lib
from sbd_jax import paths, sharding
from sbd_jax.data.chat import TEMPLATE_FILE as CHAT_TEMPLATE_FILE
from sbd_jax.data.tokenizer import (
  TOKENIZER_SIDECARS,
  WORKDIR_TOKENIZER_DIR,
  HFTokenizer,
  resolve_tokenizer_file,
)
from sbd_jax.hf import param_map
from sbd_jax.hf.config_map import hf_config_from_model
from sbd_jax.hf.importer import (
  HF_CONFIG_COPY,
  HF_GENERATION_COPY,
  SAFETENSORS_FILE,
  SAFETENSORS_INDEX,
  abstract_params,
)
from sbd_jax.model.architectures import ModelConfig
from sbd_jax.run import checkpointing
from sbd_jax.run import workdir as workdir_lib

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def save_hf_weights(
  params: nnx.State | dict,
  cfg: ModelConfig,
  out: str,
  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
  """Write params as HF safetensors (sharded with an index when larger than one shard)."""
  from safetensors.numpy import save_file

  pure = params if isinstance(params, dict) else nnx.to_pure_dict(params)
  entries = list(param_map.entries(cfg))

  def tensor(path: param_map.Path):  # one layer's slice of a stacked array, when scanned
    stored, layer = param_map.stored_at(cfg, path)
    array = param_map.get_path(pure, stored)
    return array if layer is None else array[layer]

  def nbytes(path: param_map.Path) -> int:
    stored, layer = param_map.stored_at(cfg, path)
    array = param_map.get_path(pure, stored)
    return array.nbytes if layer is None else array.nbytes // array.shape[0]

  sizes = [nbytes(path) for _, path, _ in entries]
  groups: list[list[int]] = [[]]
  used = 0
  for i, size in enumerate(sizes):
    if groups[-1] and used + size > max_shard_bytes:
      groups.append([])
      used = 0
    groups[-1].append(i)
    used += size
  names = (
    [SAFETENSORS_FILE]
    if len(groups) == 1
    else [f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors" for g in range(len(groups))]
  )
  weight_map = {}
  for file, group in zip(names, groups):
    tensors = {}
    for i in group:
      hf_name, path, transform = entries[i]
      host = np.asarray(jax.device_get(tensor(path)))
      tensors[hf_name] = transform.to_hf(host)
      weight_map[hf_name] = file
    save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
    del tensors
  if len(names) > 1:
    with open(os.path.join(out, SAFETENSORS_INDEX), "w") as f:
      json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)
  return [os.path.join(out, n) for n in names]


def _source_dir(c: ml_collections.ConfigDict, workdir: str) -> str | None:
  """Where the imported model's original HF config lives: this workdir or the one trained from
  (either may be in a bucket)."""
  candidates = [workdir]
  if c.get("train") and c.train.get("init_from") not in (None, "", "random"):
    candidates.append(str(paths.resolve(c.train.init_from.rstrip("/")).parent))
  return next((d for d in candidates if epath.Path(d, HF_CONFIG_COPY).is_file()), None)


def _read_json(path: str) -> dict[str, Any]:
  return json.loads(epath.Path(path).read_text(encoding="utf-8"))


def export_hf(
  workdir: str,
  out: str,
  *,
  params_dir: str | None = None,
  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
  """Write the params of `workdir` (default <workdir>/params; either may be in a bucket) as an
  HF model directory `out`, a local one."""
  if paths.is_remote(out):
    raise ValueError(f"out={out}: the HF files are written to a local directory; copy it after")
  workdir, out = str(paths.resolve(workdir)), os.path.abspath(out)
  c = workdir_lib.read_config(workdir)
  cfg = config_lib.to_model_config(c)
  # "words": the vocabulary the run built in <workdir>/tokenizer; else a tokenizer.json path.
  tokenizer_path = (
    os.path.join(workdir, WORKDIR_TOKENIZER_DIR) if c.tokenizer == "words" else c.tokenizer
  )
  tokenizer = HFTokenizer.from_path(
    tokenizer_path, mask_id=c.sbd.mask_id, model_vocab_size=cfg.vocab_size
  )
  mesh = sharding.make_mesh((1, -1, 1))
  params = checkpointing.load_params(
    params_dir or os.path.join(workdir, checkpointing.PARAMS_DIR),
    abstract_params(cfg, mesh, sharding.PARAM_RULES),
  )

  os.makedirs(out, exist_ok=True)
  source = _source_dir(c, workdir)
  base = _read_json(os.path.join(source, HF_CONFIG_COPY)) if source else {}
  token_ids = dict(
    bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id
  )
  token_ids = {k: v if base.get(k) is None else base[k] for k, v in token_ids.items()}
  hf_cfg = hf_config_from_model(cfg, base=base, sbd_mask_token_id=tokenizer.mask_id, **token_ids)
  generation = (
    _read_json(os.path.join(source, HF_GENERATION_COPY))
    if source and epath.Path(source, HF_GENERATION_COPY).is_file()
    else {}
  )
  generation = {k: v for k, v in generation.items() if k != "transformers_version"}
  generation.setdefault("bos_token_id", hf_cfg["bos_token_id"])
  generation.setdefault("eos_token_id", hf_cfg["eos_token_id"])
  generation.setdefault("pad_token_id", hf_cfg["pad_token_id"])
  # Plain `generate` must never emit the SBD mask token; SBD samplers read sbd_mask_token_id.
  generation.update(
    sbd_mask_token_id=tokenizer.mask_id,
    suppress_tokens=sorted({*(generation.get("suppress_tokens") or []), tokenizer.mask_id}),
  )

  if jax.process_index() == 0:
    save_hf_weights(params, cfg, out, max_shard_bytes)
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
      json.dump(generation, f, indent=2)
    tokenizer_file = resolve_tokenizer_file(tokenizer_path)
    _copy(tokenizer_file, os.path.join(out, "tokenizer.json"))
    for name in (*TOKENIZER_SIDECARS, CHAT_TEMPLATE_FILE):  # the chat template travels too
      src = os.path.join(os.path.dirname(tokenizer_file), name)
      if epath.Path(src).is_file():
        _copy(src, os.path.join(out, name))
  log.info("exported %s -> %s", workdir, out)
  return out


def _copy(src: str, dst: str) -> None:
  """A file from a local path or a bucket to a local path."""
  with open(dst, "wb") as f:
    f.write(epath.Path(src).read_bytes())
