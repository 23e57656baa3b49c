"""Loading a workdir's params export, the evaluation report, and the two CLIs' error paths."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sbd_jax import checkpointing, evaluate, sample, sampler
from sbd_jax import config as config_lib
from sbd_jax.architectures import tiny
from sbd_jax.model import Transformer


def _config():
  c = config_lib.base_config(
    tiny(num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
  )
  c.sample.num_problems = 4
  c.sample.max_new_tokens = 12
  c.sample.block_size = 4
  c.sample.batch_size = 4
  return c


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("run"))
  c = _config()
  checkpointing.write_config(path, c)
  model = nnx.jit(lambda: Transformer(config_lib.to_model_config(c), rngs=nnx.Rngs(0)))()
  checkpointing.export_params(path, nnx.state(model, nnx.Param))
  return path


def test_loader_restores_the_exported_params(workdir):
  model, config, tokenizer, mask_id = sampler.load_sampling_model(workdir)
  assert model.cfg.attention_impl == "dense" and mask_id == tokenizer.mask_id == 259
  expected = nnx.jit(lambda: Transformer(config_lib.to_model_config(config), rngs=nnx.Rngs(0)))()
  want = jax.tree.leaves(nnx.state(expected, nnx.Param))
  got = jax.tree.leaves(nnx.state(nnx.merge(model.graphdef, model.state), nnx.Param))
  assert len(want) == len(got) == len(jax.tree.leaves(model.state)) - 2  # + 2 RoPE tables
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)


def test_report_after_training(workdir, capsys):
  results = evaluate.report_after_training(workdir, _config())
  table = capsys.readouterr().out
  assert "NTP" in table and "SBD eb_entropy γ=0.35" in table
  assert results["num_problems"] == 4
  assert 0.0 <= results["ntp"]["accuracy"] <= 1.0
  (row,) = results["sbd"]
  assert row["rule"] == "eb_entropy" and row["gamma"] == 0.35 and row["nfe_speedup"] > 0


def test_gamma_zero_has_no_speedup(workdir):
  """γ = 0 reveals one token per forward: the NFE of SBD equals NTP's when neither stops early."""
  results = evaluate.evaluate_workdir(workdir, gammas=[0.0], num_problems=4)
  assert results["ntp"]["mean_nfe"] == results["sbd"][0]["mean_nfe"] == 12
  assert results["sbd"][0]["nfe_speedup"] == 1.0


def test_sample_workdir(workdir):
  (result,) = sample.sample_workdir(
    workdir, ["Q: Ana has 3 pens.\nA:"], block_size=4, max_new_tokens=12
  )
  assert set(result) >= {"sbd", "ntp", "sbd_nfe", "ntp_nfe", "nfe_speedup"}
  assert result["ntp_nfe"] == 12 and 1 <= result["sbd_nfe"] <= 12
  assert "SBD" in sample.format_results([result])


def test_bad_requests(workdir, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    sampler.load_sampling_model(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="no params export"):
    sampler.load_sampling_model(str(tmp_path))
  with pytest.raises(ValueError, match="unknown reveal rule"):
    evaluate.evaluate_workdir(workdir, rules=["nope"])
  with pytest.raises(ValueError, match="gammas must be >= 0"):
    evaluate.evaluate_workdir(workdir, gammas=[-1.0])
  with pytest.raises(ValueError, match="empty"):
    sample.sample_workdir(workdir, [""])


@pytest.mark.parametrize("module", ["sbd_jax.sample", "sbd_jax.evaluate"])
def test_cli_missing_workdir_is_one_clear_line(module, tmp_path):
  args = [sys.executable, "-m", module, f"--workdir={tmp_path / 'nope'}"]
  if module == "sbd_jax.sample":
    args.append("--prompt=hi")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode != 0
  assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
