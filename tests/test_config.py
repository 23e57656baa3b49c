"""Every shipped config loads and validates; invalid values fail with one-line errors."""

import glob
import os

import pytest

from sbd_jax import config as config_lib
from sbd_jax.data.tokenizer import ByteTokenizer

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


load = config_lib.from_file


@pytest.mark.parametrize(
  "path", sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py"))), ids=os.path.basename
)
def test_every_config_loads_and_validates(path):
  c = load(path)
  config_lib.validate(c)
  model = config_lib.to_model_config(c)
  assert model.vocab_size > 0
  assert 0 <= c.sbd.mask_id < model.vocab_size or c.sbd.mask_id == -1


def test_8b_configs_carry_the_paper_recipe():
  """The paper's budget (2M-token batches, ~70B tokens) follows from the fields, and the
  config validates on a 64-chip slice with FSDP over every chip."""
  for name in ("llama8b.py", "qwen3_8b.py"):
    c = load(os.path.join(CONFIG_DIR, name))
    tokens_per_batch = c.train.batch_size * c.train.seq_len
    assert tokens_per_batch == 2 * 1024 * 1024
    assert 69e9 < tokens_per_batch * c.train.steps < 72e9
    assert (c.sbd.k_min, c.sbd.k_max, c.sbd.mode) == (2, 16, "sbd")
    config_lib.validate(c, num_devices=64)


@pytest.mark.parametrize(
  "change, message",
  [
    (
      lambda c: setattr(c.sbd, "k_min", 9) or setattr(c.sbd, "k_max", 4),
      r"sbd.k_min \(9\) must be >= 1 and <= sbd.k_max \(4\)",
    ),
    (lambda c: setattr(c.sbd, "mask_id", 5000), r"sbd.mask_id 5000 is outside the model vocab"),
    (lambda c: setattr(c.sbd, "mask_id", 258), r"must differ from eos/bos/pad"),
    (lambda c: setattr(c.sbd, "mode", "ntpp"), r"sbd.mode must be one of"),
    (lambda c: setattr(c.sbd, "ntp_steps", 1000), r"sbd.ntp_steps \(1000\) must be >= 0 and <"),
    (lambda c: setattr(c.mesh, "shape", (3, 1, 1)), r"mesh.shape \(3, 1, 1\) does not match the 8"),
    (lambda c: setattr(c.train, "batch_size", 6), r"not divisible by the 8 data-parallel"),
    (
      lambda c: setattr(c.model, "vocab_size", 259) or setattr(c.sbd, "mask_id", 5),
      r"tokenizer vocabulary \(260\) is larger",
    ),
    (lambda c: setattr(c.model, "param_dtype", "float33"), r"model:"),
  ],
)
def test_invalid_values_fail_with_one_line_errors(change, message):
  c = config_lib.base_config()
  c.train.batch_size = 8
  change(c)
  with pytest.raises(config_lib.ConfigError, match=message) as info:
    config_lib.validate(c, num_devices=8, tokenizer=ByteTokenizer())
  assert "\n" not in str(info.value)


def test_typos_in_config_fields_are_rejected():
  c = load(os.path.join(CONFIG_DIR, "tiny.py"))
  c.lock()
  with pytest.raises(AttributeError, match="k_min"):
    c.sbd.k_mni = 3
