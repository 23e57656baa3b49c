"""The train-step benchmark: both modes time real steps, and its MFU arithmetic."""

import os

import pytest

from benchmarks import train_step
from sbd_jax import config as config_lib
from sbd_jax.tpu.step_time import count_params_of

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


def _config(seq_len=32, rows=2):
  c = config_lib.from_file(os.path.join(CONFIGS, "tiny.py"))
  c.train.seq_len, c.train.batch_size = seq_len, rows
  c.model.attention_chunk = seq_len
  return c


@pytest.mark.integration  # real train steps
def test_both_modes_take_real_steps_and_the_cpu_gets_no_mfu():
  c = _config()
  times = train_step.time_steps(c, steps=2)
  assert set(times) == {"ntp", "sbd"} and all(len(t) == 2 and min(t) > 0 for t in times.values())
  r = train_step.summarize(c, times, peak_flops=0.0)
  assert "mfu" not in r
  assert r["processed_tokens_per_s"]["sbd"] == pytest.approx(
    2 * 2 * 32 / r["seconds"]["sbd"]
  )  # 2 rows x 2L processed
  assert "MFU" not in train_step.format_markdown(r)


def test_mfu_counts_the_rows_model_flops_and_twice_them_processed_by_sbd():
  c = _config(seq_len=64, rows=4)
  model = config_lib.to_model_config(c)
  n = count_params_of(model)
  # independent of metrics.flops_per_token: 6 per multiplying parameter (tied table counted once
  # as the output projection) and 12 * layers * heads * head_dim * L / 2 for attention
  per_token = 6 * n + 12 * model.num_layers * model.num_heads * model.head_dim * 64 / 2
  times = {"ntp": [0.5, 0.4, 0.6], "sbd": [1.0, 1.1, 0.9]}
  r = train_step.summarize(c, times, peak_flops=1e12)
  row_flops = per_token * 4 * 64
  assert r["mfu"]["rows"]["ntp"] == pytest.approx(row_flops / 0.5 / 1e12)
  assert r["mfu"]["rows"]["sbd"] == pytest.approx(row_flops / 1.0 / 1e12)
  assert r["mfu"]["processed"]["ntp"] == pytest.approx(r["mfu"]["rows"]["ntp"])
  assert r["mfu"]["processed"]["sbd"] == pytest.approx(2 * r["mfu"]["rows"]["sbd"])
  assert r["sbd_over_ntp"] == pytest.approx(2.0)
  table = train_step.format_markdown({**r, "peak_memory_bytes": 3 * 2**30})
  assert f"{100 * row_flops / 1e12:.1f} %" in table  # SBD, processed tokens: 2 x rows / 1.0 s
  assert "peak memory in use 3.0 GiB" in table


def test_the_one_gpu_config_is_llama_3_2_1b():
  c = config_lib.from_file(os.path.join(CONFIGS, "llama3_2_1b.py"))
  assert c.model.attention_impl != "splash"  # splash is TPU-only
  assert c.sbd.k_max == 16 and c.sbd.matp_weight == 1.0
  assert count_params_of(config_lib.to_model_config(c)) == 1_235_814_400
