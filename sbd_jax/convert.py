"""CLI: convert between Hugging Face model directories and sbd_jax workdirs.

python -m sbd_jax.convert hf-to-orbax --hf_dir=DIR --out=DIR [--mask_token=TOK] [--dtype=bfloat16]
python -m sbd_jax.convert orbax-to-hf --workdir=DIR --out=DIR
"""

from __future__ import annotations

import logging

from absl import app, flags

from sbd_jax import cli

_HF_DIR = flags.DEFINE_string(
  "hf_dir", None, "hf-to-orbax: HF model directory (config.json, *.safetensors, tokenizer.json)."
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "orbax-to-hf: workdir holding config.json and params/ (a converted model or a training run).",
)
_OUT = flags.DEFINE_string("out", None, "Output directory.")
_MASK_TOKEN = flags.DEFINE_string(
  "mask_token",
  None,
  "hf-to-orbax: SBD mask token (a token string or an id); default: a reserved/unused id.",
)
_DTYPE = flags.DEFINE_string(
  "dtype", None, "hf-to-orbax: param/compute dtype; default: the checkpoint's dtype."
)
_MESH = flags.DEFINE_list(
  "mesh",
  ["1", "-1", "1"],
  "hf-to-orbax: (data, fsdp, tensor) mesh the params land on while converting.",
)
_PARAMS = flags.DEFINE_string(
  "params", None, "orbax-to-hf: params checkpoint (default <workdir>/params)."
)

COMMANDS = ("hf-to-orbax", "orbax-to-hf")


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"give exactly one command: {' | '.join(COMMANDS)}")
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  from sbd_jax import sharding
  from sbd_jax.data.tokenizer import TokenizerError
  from sbd_jax.hf.config_map import HFConversionError

  def need(flag):
    if not flag.value:
      raise app.UsageError(f"{argv[1]} needs --{flag.name}")
    return flag.value

  try:
    if argv[1] == "hf-to-orbax":
      from sbd_jax.hf.importer import import_hf

      mesh = sharding.make_mesh([int(s) for s in _MESH.value])
      c = import_hf(
        need(_HF_DIR), need(_OUT), mask_token=_MASK_TOKEN.value, dtype=_DTYPE.value, mesh=mesh
      )
      print(
        f"wrote {_OUT.value} (mask id {c.sbd.mask_id}); fine-tune with "
        f"--config.train.init_from={c.train.init_from} --config.tokenizer={c.tokenizer}"
      )
    else:
      from sbd_jax.hf.exporter import export_hf

      print(f"wrote {export_hf(need(_WORKDIR), need(_OUT), params_dir=_PARAMS.value)}")
  except (HFConversionError, TokenizerError, FileNotFoundError, ValueError) as e:
    raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  cli.run(main)
