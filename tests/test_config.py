"""Every shipped config loads and validates; invalid values fail with one-line errors."""

import glob
import os
import subprocess
import sys

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


@pytest.mark.parametrize("name", ["llama8b.py", "qwen3_8b.py"])
def test_8b_configs_carry_the_paper_recipe(name):
  """Every recipe field of the 8B configs: the paper's budget (2M-token batches, ~70B tokens),
  objective and optimizer, and this project's two named choices beyond it (row-tiled blocks,
  the positions past EOS trained to EOS); the config validates on a 64-chip slice with FSDP
  over every chip."""
  c = load(os.path.join(CONFIG_DIR, name))
  tokens_per_batch = c.train.batch_size * c.train.seq_len
  assert tokens_per_batch == 2 * 1024 * 1024
  assert 69e9 < tokens_per_batch * c.train.steps < 72e9
  assert (c.sbd.k_min, c.sbd.k_max, c.sbd.mode, c.sample.block_size) == (2, 16, "sbd", 16)
  assert tuple(c.sbd.eta_beta) == (1.0, 1.0)  # η ~ U(0, 1), per token
  assert (c.sbd.full_block_prob, c.sbd.matp_weight) == (0.0, 1.0)  # equal weights
  assert (c.sbd.ntp_steps, c.sbd.ntp_fraction) == (0, 0.0)  # a pretrained model: no NTP phase
  assert (c.optim.lr, c.optim.warmup_steps, c.optim.end_lr_ratio) == (3e-4, 200, 0.0)
  assert c.sbd.block_anchor == "row" and c.sbd.train_past_eos
  assert config_lib.eos_tail_length(c) == c.sample.block_size - 1  # every decode block's tail
  assert c.train.pretrained and c.train.init_from == ""
  config_lib.validate(c, num_devices=64)


@pytest.mark.integration
def test_a_fine_tune_config_without_its_params_stops_in_one_line(tmp_path):
  """The 8B configs fine-tune a pretrained model: with no train.init_from, training stops before
  anything is built or written, unless random weights are asked for by name."""
  c = load(os.path.join(CONFIG_DIR, "llama8b.py"))
  with pytest.raises(config_lib.ConfigError, match="train.init_from=random") as info:
    config_lib.random_init(c)
  assert "\n" not in str(info.value)
  c.train.init_from = "random"
  assert config_lib.random_init(c)
  c.train.init_from = "/ckpt/llama31_8b/params"
  assert not config_lib.random_init(c)
  workdir = tmp_path / "run"
  proc = subprocess.run(
    [sys.executable, "-m", "sbd_jax.train", "--config=configs/llama8b.py", f"--workdir={workdir}"],
    capture_output=True, text=True, cwd=os.path.dirname(CONFIG_DIR), timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )  # fmt: skip
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error: this config fine-tunes")
  assert not workdir.exists()


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
    (
      lambda c: setattr(c.sbd, "k_max", 8),
      r"sample.block_size \(16\) is larger than the largest block trained, sbd.k_max \(8\)",
    ),
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
