"""Ahead-of-time compilation for TPU slices described by libtpu on this CPU machine: topology
names, XLA's memory and FLOPs for the real train step, the fit verdict, and what chunking the
cross-entropy saves."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from sbd_jax import config as config_lib
from sbd_jax.tpu import cost, programs, report, step_time
from sbd_jax.tpu.topology import parse_topology, topology_devices
from sbd_jax.training import metrics


@pytest.mark.parametrize(
  "name, expected",
  [
    ("v5p-8", ("v5p", "v5p:2x2x1")),  # 8 TensorCores = 4 chips
    ("v5p-16", ("v5p", "v5p:2x2x2")),
    ("v5p-128", ("v5p", "v5p:4x4x4")),
    ("v4-32", ("v4", "v4:2x2x4")),
    ("v5e-8", ("v5e", "v5e:2x4")),  # v5e / v6e slices count chips
    ("v5litepod-16", ("v5e", "v5e:4x4")),
    ("v6e-256", ("v6e", "v6e:16x16")),
    ("v5p:2x4x4", ("v5p", "v5p:2x4x4")),
  ],
)
def test_slice_names_become_chip_grids(name, expected):
  assert parse_topology(name) == expected


@pytest.mark.parametrize("name", ["v7x-8", "v5p", "v5p-abc", "v6e-12"])
def test_unknown_slices_are_config_errors(name):
  with pytest.raises(config_lib.ConfigError):
    parse_topology(name)


_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason='needs libtpu to describe TPU slices (pip install -e ".[test]" or ".[tpu]")',
)


def needs_libtpu(test):
  """A test that compiles for a described TPU slice: it needs libtpu, and it is part of the
  integration tier (each compile takes seconds to a minute on a CPU)."""
  return pytest.mark.integration(_libtpu(test))


def small_config(**train):
  c = config_lib.base_config()
  c.model.update(num_layers=1, embed_dim=64, num_heads=2, num_kv_heads=1, head_dim=32)
  c.model.update(mlp_dim=128, vocab_size=16_384)
  c.train.update(**{"batch_size": 8, "seq_len": 512, **train})
  c.mesh.shape = (1, -1, 1)
  c.sbd.mask_id = 3
  return c


@needs_libtpu
def test_train_step_compiles_for_a_v5p_slice_and_chunked_loss_saves_memory():
  dense = report.report(small_config(), "v5p-8")
  assert dense["devices"] == 4 and dense["device_kind"].startswith("TPU v5")
  assert dense["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and dense["fits"]
  b = dense["bytes_per_device"]
  assert 0 < b["arguments"] and 0 < b["temporaries"] < b["total"] <= dense["hbm_per_device"]
  assert dense["hbm_per_device"] == 95 * 2**30
  # The report's FLOPs are the analytic count (6 N per token plus attention); XLA's own count
  # agrees within 30 % on this unrolled one-layer model (with scanned layers it counts one).
  c = small_config()
  tokens_per_device = 2 * c.train.batch_size * c.train.seq_len / dense["devices"]
  per_token = metrics.flops_per_token(
    config_lib.to_model_config(c), dense["params"], c.train.seq_len
  )
  assert dense["flops_per_device"] == pytest.approx(per_token * tokens_per_device, rel=1e-9)
  assert dense["xla_flops_per_device"] == pytest.approx(per_token * tokens_per_device, rel=0.3)
  # The float32 logits of 2 rows x 1024 positions x 16k vocabulary are 128 MiB per device;
  # with 256-token chunks the step's temporaries shrink by more than half of that.
  chunked = report.report(small_config(loss_chunk=256), "v5p-8")
  logits_bytes = 2 * 2 * 512 * 16_384 * 4
  saved = b["temporaries"] - chunked["bytes_per_device"]["temporaries"]
  assert saved > logits_bytes / 2, (b, chunked["bytes_per_device"])


@needs_libtpu
def test_a_step_that_does_not_fit_exits_1_with_one_line(tmp_path):
  config_file = tmp_path / "big.py"
  config_file.write_text(
    "from sbd_jax import config\n"
    "def get_config():\n"
    "  c = config.base_config()\n"
    "  c.model.update(num_layers=1, vocab_size=65_536)\n"
    "  c.train.update(batch_size=64, seq_len=8192)\n"
    "  c.mesh.shape = (1, -1, 1)\n"
    "  c.sbd.mask_id = 3\n"
    "  return c\n"
  )
  result = subprocess.run(
    [sys.executable, "-m", "sbd_jax.aot", f"--config={config_file}", "--topology=v5e-4"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 1, result.stderr[-2000:]
  assert "DOES NOT FIT" in result.stdout
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "does not fit on TPU v5 lite" in errors[0]
  assert "exceeds available HBM" in errors[0]  # the TPU compiler's own numbers
  # libtpu loaded off a TPU VM prints nothing of its own (no worker-hostname probe).
  assert "worker hostname" not in result.stderr and "InitGoogle" not in result.stderr


@needs_libtpu
def test_the_decode_loop_compiles_and_its_cache_grows_with_the_context():
  """--mode=decode compiles the sampler's while loop; a 4x longer KV cache costs XLA more
  bytes (arguments and temporaries), by at least the cache's own size."""
  c = small_config()
  short = report.report(
    c, "v5p-8", decode=programs.DecodeShape(rows=4, prompt_len=64), max_new_tokens=64
  )
  long = report.report(
    c, "v5p-8", decode=programs.DecodeShape(rows=4, prompt_len=448), max_new_tokens=64
  )
  assert short["program"] == "decode" and short["fits"] and long["fits"]
  cfg = config_lib.to_model_config(c)
  itemsize = np.dtype(cfg.compute_dtype).itemsize
  slot_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize  # K and V
  extra_cache = 4 * (448 - 64) * slot_bytes / 4  # rows split over 4 devices
  grown = long["bytes_per_device"]["total"] - short["bytes_per_device"]["total"]
  assert grown >= extra_cache, (short["bytes_per_device"], long["bytes_per_device"])


@needs_libtpu
@pytest.mark.parametrize("mode", ["ntp", "sbd"])
def test_the_prefill_computes_logits_only_where_the_sampler_reads_them(mode):
  """The prompt's logits are never materialised: from a 64- to a 448-slot prompt the decode
  program's temporaries grow by less than a quarter of what the extra prompt positions' float32
  logits would take (the vocabulary-sized arrays of the block's positions do not grow)."""
  c = small_config()
  temporaries = {}
  for prompt_len in (64, 448):
    shape = programs.DecodeShape(rows=4, prompt_len=prompt_len)
    r = report.report(c, "v5p-8", decode=shape, max_new_tokens=64, mode=mode)  # a row per chip
    temporaries[prompt_len] = r["bytes_per_device"]["temporaries"]
  extra_logits = (448 - 64) * c.model.vocab_size * 4
  assert temporaries[448] - temporaries[64] < extra_logits / 4, temporaries


@needs_libtpu
def test_the_splash_train_step_compiles_for_tpu():
  """Mosaic lowers the splash kernels (one per block size, behind a lax.switch) inside the
  scanned layers."""

  c = small_config()
  c.model.update(attention_impl="splash", scan_layers=True, remat="full", num_layers=2)
  c.sbd.update(block_anchor="row", k_min=2, k_max=4)  # 4 kernels (16 in the 8B recipe)
  c.sample.block_size = 4
  _, topology = parse_topology("v5p-8")
  compiled, _, _ = programs.compile_train_step(c, topology_devices(topology))
  # Mosaic kernels (splash's forward, dq and dkv) appear as TPU custom calls; XLA's own ops
  # never do.
  assert compiled.as_text().count("tpu_custom_call") >= 3


def test_sbd_speedup_from_forward_times():
  """k time(1) / (time(2k) + (l - 1) time(k)), l = k / r, on hand-made times."""
  from benchmarks import tpu_time

  flat = {"1": 1.0, "16": 1.0, "32": 1.0}  # memory-bound: every forward costs the same
  assert tpu_time.sbd_speedup(flat, 16, 4.0) == pytest.approx(4.0)
  assert tpu_time.sbd_speedup(flat, 16, 16.0) == pytest.approx(16.0)
  rising = {"1": 1.0, "16": 2.0, "32": 3.0}
  assert tpu_time.sbd_speedup(rising, 16, 4.0) == pytest.approx(16 / (3 + 3 * 2))


@needs_libtpu
def test_xla_estimates_the_decode_forward_and_its_layers_add_up():
  """XLA's TPU estimate of the real cached forward: positive, not cheaper for more tokens, and
  the one-and-two-layer extrapolation matches compiling every layer."""
  from benchmarks import tpu_time

  c = small_config()
  c.model.num_layers = 4
  out = tpu_time.run(
    c, ["v5p"], batches=[1], ns=[1, 2, 4], cache_length=128, block_size=2, check=True
  )
  chip = out["chips"][0]
  t = chip["time_s"]["1"]
  assert all(v > 0 for v in t.values()) and t["4"] >= 0.95 * t["1"]
  assert 0.9 < chip["full_layers_check"]["ratio"] < 1.1, chip["full_layers_check"]
  assert chip["sbd_speedup"]["1"]["2.0"] == pytest.approx(tpu_time.sbd_speedup(t, 2, 2.0))
  assert "| v5p" in tpu_time.format_markdown(out)
  with pytest.raises(ValueError, match="must include 1, the block size and twice it"):
    tpu_time.run(c, ["v5p"], batches=[1], ns=[1, 2], cache_length=128, block_size=2, check=False)


@needs_libtpu
def test_ops_without_a_cost_model_are_taken_back_on_v5e():
  """On v5e the compiler reassembles sliced prefetches of an 8B layer's weights with ops it has
  no cost model for (each adds -1 s to optimal_seconds). With those taken back, the estimate
  is within a few per cent of the same program compiled without sliced prefetches."""
  from benchmarks import tpu_time

  c = small_config()  # with Llama-3.1-8B's layer: the size at which XLA slices prefetches
  c.model.update(embed_dim=4096, mlp_dim=14336, num_heads=32, num_kv_heads=8, head_dim=128)
  _, devices = tpu_time.slice_devices("v5e")
  point = dict(batch=1, cache_length=1024, n=1, num_layers=2)
  sliced, _ = tpu_time.compile_forward(c, devices, **point)
  whole, _ = tpu_time.compile_forward(
    c, devices, **point, compiler_options={"xla_tpu_sliced_prefetch_max_slices": 1}
  )
  assert cost.uncosted_ops(sliced) > 0 and cost.uncosted_ops(whole) == 0
  ratio = cost.estimated_seconds(sliced) / cost.estimated_seconds(whole)
  assert 0.85 < ratio <= 1.0, ratio


@needs_libtpu
def test_two_slices_get_a_hybrid_mesh_and_the_train_step_compiles_across_them():
  """Devices of two v5p-8 slices: by default the slices split the data axis (fsdp and tensor
  stay within a slice, on its ICI links), mesh.dcn_shape can put them on fsdp instead, a
  dcn_shape that does not match the slices or the mesh is a one-line error; the real train
  step compiles for the pair."""
  from sbd_jax import sharding

  devices = topology_devices("v5p:2x2x1", num_slices=2)
  slice_of = np.vectorize(lambda d: d.slice_index)
  mesh = sharding.make_mesh((2, 4, 1), devices)
  assert (slice_of(mesh.devices)[:, :, 0] == [[0] * 4, [1] * 4]).all()
  mesh = sharding.make_mesh((1, 8, 1), devices, dcn_shape=(1, 2, 1))
  assert (slice_of(mesh.devices)[0, :, 0] == [0] * 4 + [1] * 4).all()
  with pytest.raises(ValueError, match=r"product is the number of slices the devices form \(2\)"):
    sharding.make_mesh((2, 4, 1), devices, dcn_shape=(4, 1, 1))
  with pytest.raises(ValueError, match=r"\(1, 8, 1\) is not divisible by mesh.dcn_shape"):
    sharding.make_mesh((1, 8, 1), devices)  # the slices default to the data axis, of size 1

  c = small_config()
  c.mesh.shape = (2, -1, 1)
  r = report.report(c, "v5p-8", num_slices=2)
  assert r["topology"] == "2 x v5p:2x2x1" and r["devices"] == 8 and r["fits"]
  assert r["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}


@needs_libtpu
def test_the_tpu_decode_updates_its_kv_cache_in_place():
  """No copy of a KV-cache layer in the SBD decode compiled for TPU with head_dim 128 (the 8B
  presets'), rows moving alone (per-row cache writes: a scatter) or in lockstep. The cache is
  heads-first there; slots-first, rows alone got a copy of every layer's K and V in each of the
  three forwards. With head_dim below the TPU's 128 lanes, rows alone still copy."""
  c = small_config()
  c.model.update(head_dim=128)
  shape = programs.DecodeShape(rows=8, prompt_len=448)  # 2 rows per device
  assert programs.decode_settings(c, max_new_tokens=64).rows_move_alone(shape.rows)
  for lockstep in (False, True):
    r = report.report(
      c, "v5p-8", decode=shape, max_new_tokens=64, lockstep=lockstep, verify=not lockstep
    )
    assert r["cache_layer_copies"] == 0, f"lockstep={lockstep}"
  c.model.update(head_dim=32)
  alone = report.report(c, "v5p-8", decode=shape, max_new_tokens=64)
  assert alone["cache_layer_copies_in_loops"] > 0  # in every forward, not once per call
  assert "compare with --lockstep --noverify" in report.format_report(
    alone
  )  # the report says what to try
  assert "--lockstep" not in report.format_report(r)


@needs_libtpu
def test_the_tpu_ntp_decode_copies_its_cache_at_most_once_per_call():
  """NTP's one-token forwards keep the cache in a layout of their own on TPU: the prefill's keys
  and values are copied into it once per call (in the entry computation), never per forward."""
  c = small_config()
  c.model.update(head_dim=128)
  shape = programs.DecodeShape(rows=8, prompt_len=256)
  r = report.report(c, "v5p-8", decode=shape, max_new_tokens=64, mode="ntp")
  assert r["cache_layer_copies_in_loops"] == 0 < r["cache_layer_copies"]
  assert "(0 inside its loops, the rest once per call)" in report.format_report(r)


@needs_libtpu
@pytest.mark.parametrize("mode, refill_rows", [("sbd", 2), ("ntp", 1)])
def test_the_tpu_refill_loop_updates_its_kv_cache_in_place(mode, refill_rows):
  """The refill loop (`queue.decode_queue`) compiled for a v5p-8 slice, its rows split over the 4
  chips and its cache heads-first with head_dim 128: no copy of a whole KV-cache layer anywhere
  in it, and the report says what it compiled. NTP refilling one row at a time is the case
  that copied (each layer to the prefill's layout and back at every refill) while the new row
  went in as a dynamic-update-slice."""
  c = small_config()
  c.model.update(head_dim=128)
  shape = programs.DecodeShape(rows=8, prompt_len=256, queue=32)
  sampling = dict(max_new_tokens=128, mode=mode, refill=True, refill_rows=refill_rows)
  r = report.report(c, "v5p-8", decode=shape, **sampling)
  assert r["fits"] and r["cache_layer_copies"] == r["cache_layer_copies_in_loops"] == 0
  text = report.format_report(r)
  assert f"a queue of 32 prompts, rows refilled {refill_rows} at a time" in text
  assert "copies of a KV-cache layer in the program: 0 (0 inside its loops" in text
  with pytest.raises(config_lib.ConfigError, match="queue"):
    report.report(c, "v5p-8", decode=dataclasses.replace(shape, queue=0), **sampling)


def test_splash_computes_every_tile_its_mask_does_not_wholly_hide():
  """The tile pairs the step estimate charges splash for: causal rows, and SBD [clean ; block]
  rows for several k and tiles, against the tiles of the dense mask with anything visible."""
  from sbd_jax.attention import splash

  for length, tile, k in [(64, 8, 0), (64, 16, 0), (32, 8, 4), (32, 8, 3), (48, 8, 5), (64, 16, 2)]:
    if k:
      mask = splash.dense_mask(length // 2, k)
    else:
      mask = np.tril(np.ones((length, length), bool))
    n = length // tile
    tiles = mask.reshape(n, tile, n, tile).any(axis=(1, 3))
    assert step_time.splash_tile_pairs(length, tile, k) == tiles.sum(), (length, tile, k)


def dense_step_config(objective: str, num_layers: int, **train):
  c = small_config(**train)
  c.model.update(num_layers=num_layers, attention_impl="dense", remat="none")
  c.sbd.update(mode=objective, k_min=2, k_max=4, block_anchor="row")
  c.sample.block_size = 4
  return c


@needs_libtpu
@pytest.mark.parametrize("objective", ["ntp", "sbd"])
def test_the_step_estimate_extrapolates_the_layers_and_counts_the_model_flops(objective):
  """On one chip, with dense attention (ops XLA costs, computing every score of its regions),
  the step's FLOPs extrapolated from one and two layers to three equal the analytic count
  within 5 % (6 per multiplying parameter per processed token, plus the scores dense
  attention computes: L keys per query for NTP; for SBD's 2L queries 2 L^2 + L W scores, W =
  2 k_max - 1), and its time and FLOPs equal the three-layer step compiled whole."""
  c = dense_step_config(objective, num_layers=3, batch_size=1)
  devices = topology_devices("v5p:2x2x1")[:1]
  e = step_time.estimate_train_step(c, devices, {"data": 1, "fsdp": 1, "tensor": 1}, 459e12)
  assert e.attention_s == 0 and e.seconds == e.xla.seconds > 0
  whole_c = c.copy_and_resolve_references()
  whole_c.model.scan_layers = False
  compiled, n_params, _ = programs.compile_train_step(whole_c, devices)
  whole = step_time.StepCost.of(compiled, "three layers")
  assert e.xla.flops == pytest.approx(whole.flops, rel=0.01)
  assert e.xla.seconds == pytest.approx(whole.seconds, rel=0.05)

  cfg, seq_len = config_lib.to_model_config(c), c.train.seq_len
  tokens = seq_len * (1 if objective == "ntp" else 2)
  keys = seq_len if objective == "ntp" else seq_len + (2 * c.sbd.k_max - 1) / 2
  per_key = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  per_token = metrics.flops_per_token(cfg, n_params, seq_len) + per_key * (keys - seq_len / 2)
  assert e.xla.flops == pytest.approx(per_token * tokens, rel=0.05)
  # The executed-matmul count the estimate corrects sharded steps with, plus the scores.
  scores = per_key * keys * tokens
  assert e.xla.flops == pytest.approx(step_time.executed_matmul_flops(c, 1) + scores, rel=0.05)


def test_the_splash_estimate_compiles_one_kernel_per_layer_and_averages_the_drawn_k(monkeypatch):
  """The shallow steps are compiled with k fixed at k_max (one splash kernel, not one per k:
  the kernels are uncosted), while the kernels' time still averages k ~ U{k_min..k_max}."""

  class Compiled:
    def __init__(self, layers):
      self.layers = layers

    def cost_analysis(self):
      return {"flops": 1e9 * self.layers, "bytes accessed": 1e6, "optimal_seconds": self.layers}

    def as_text(self):
      return ""  # no ops without a cost model

  compiled_configs = []

  def fake_compile(c, devices, options=None):
    compiled_configs.append(c)
    return Compiled(c.model.num_layers), 0, 1.0

  monkeypatch.setattr(step_time, "compile_train_step", fake_compile)
  c = small_config()
  c.model.update(num_layers=4, attention_impl="splash", attention_chunk=32)
  c.sbd.update(mode="sbd", k_min=2, k_max=16, block_anchor="row")
  mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  e = step_time.estimate_train_step(c, [None], mesh, 459e12)
  assert [x.model.num_layers for x in compiled_configs] == [1, 2]
  assert all(x.sbd.k_min == x.sbd.k_max == 16 for x in compiled_configs)
  assert (c.sbd.k_min, c.sbd.k_max) == (2, 16)  # the caller's config is untouched
  assert e.attention_s == pytest.approx(step_time.splash_seconds(c, mesh, 459e12, ntp=False))
  one_k = c.copy_and_resolve_references()
  one_k.sbd.k_min = 16
  assert e.attention_s != pytest.approx(step_time.splash_seconds(one_k, mesh, 459e12, ntp=False))


@needs_libtpu
def test_a_case_whose_whole_step_does_not_fit_keeps_its_estimate(tmp_path, monkeypatch):
  from benchmarks import tpu_train_step as bench

  fake = step_time.StepEstimate(2.0, step_time.StepCost(1.0, 1e12, 1e9), 1.5, 0.5, 3.0)
  monkeypatch.setattr(step_time, "estimate_train_step", lambda *a: fake)
  out_of_memory = {"fits": False, "compiler_error": "out of memory", "hbm_per_device": 32 * 2**30}
  monkeypatch.setattr(bench, "case_memory", lambda case: out_of_memory)
  given = SimpleNamespace(
    out=str(tmp_path), cases=["calibration"], configs=[], slices=[], memory=True
  )
  monkeypatch.setattr(bench.flags, "FLAGS", given)
  bench.main([])
  saved = json.loads((tmp_path / "results.json").read_text())["results"]
  assert [r["estimate"]["step_s"] for r in saved] == [2.0, 2.0]
  assert all(r["fits"] is False for r in saved)
  assert "does not fit" in (tmp_path / "tpu_train_step.md").read_text()


@needs_libtpu
def test_the_report_derives_throughput_and_mfu_from_the_estimate():
  """`aot --mode=train` of an SBD config on a toy slice: the step is estimated, it processes 2L
  tokens per row (its processed tokens/s and MFU are twice its model ones), and MFU is the
  model FLOPs over the estimated time at the chips' peak."""
  r = report.report(dense_step_config("sbd", 2), "v5p-8", estimate=True)
  assert r["objective"] == "sbd" and r["fits"]
  e, tokens = r["estimate"], r["batch_size"] * r["seq_len"]
  assert e["step_s"] == e["xla_step_s"] > 0 and e["splash_at_peak_s"] == 0  # dense: XLA's ops
  assert e["tokens_per_s_per_chip"] == pytest.approx(tokens / e["step_s"] / 4)
  assert e["processed_tokens_per_s_per_chip"] == pytest.approx(2 * tokens / e["step_s"] / 4)
  assert r["flops_per_device"] == pytest.approx(2 * r["model_flops_per_device"])
  assert e["mfu"] == pytest.approx(r["model_flops_per_device"] / (e["step_s"] * 459e12))
  assert e["processed_mfu"] == pytest.approx(2 * e["mfu"])
  assert "tokens/s/chip" in report.format_report(r)


def test_compiler_options_read_their_values():
  from sbd_jax import aot

  options = aot.compiler_options(["a=true", "b=3", "c=0.5", "d=x_y"])
  assert options == {"a": True, "b": 3, "c": 0.5, "d": "x_y"}
  with pytest.raises(config_lib.ConfigError, match="expected NAME=VALUE"):
    aot.compiler_options(["no_value"])


@needs_libtpu
def test_the_offload_remat_policy_moves_the_named_activations_to_host_memory():
  """model.remat="offload" (MaxText's Llama policy): the layer input and the q, k, v and output
  projections of every scanned layer are kept in host memory for the backward pass; with
  "full" remat nothing is."""
  devices = topology_devices("v5p:2x2x1")
  host_bytes = {}
  for remat in ("full", "offload"):
    c = small_config(seq_len=256)
    c.model.update(num_layers=2, remat=remat, scan_layers=True)
    compiled, _, _ = programs.compile_train_step(c, devices)
    host_bytes[remat] = compiled.memory_analysis().host_temp_size_in_bytes
  cfg = config_lib.to_model_config(small_config())
  rows_tokens = 8 * 256 // 4  # per device
  width = cfg.embed_dim + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.embed_dim
  offloaded = 2 * rows_tokens * width * 2  # two layers, bfloat16
  assert host_bytes["full"] == 0 and host_bytes["offload"] >= offloaded, host_bytes


def test_the_train_step_table_calibrates_every_estimate_by_the_published_step(tmp_path):
  """calibrated = estimate x (MaxText's measured step / this project's NTP estimate of it);
  the SBD / NTP ratio pairs each SBD case with the NTP case of the same setting."""
  from benchmarks import tpu_train_step

  def result(name, objective, step_s, mfu):
    estimate = dict(
      step_s=step_s, xla_step_s=1.0, corrected_xla_step_s=1.5, splash_at_peak_s=step_s - 1.5,
      tokens_per_s_per_chip=1000.0, mfu=mfu, processed_mfu=mfu * (1 if objective == "ntp" else 2),
    )  # fmt: skip
    case = dict(name=name, config="llama8b", topology="v6e-8", objective=objective)
    return dict(case=case, estimate=estimate, batch_size=24, seq_len=8192)

  results = [
    result("calibration llama8b v6e-8 ntp", "ntp", 2.0, 0.6),
    result("calibration llama8b v6e-8 sbd", "sbd", 4.4, 0.3),
  ]
  table = tpu_train_step.format_markdown(results)
  ratio = tpu_train_step.PUBLISHED["step_s"] / 2.0
  ntp_row, sbd_row = table.splitlines()[2:4]
  assert (
    f"| {2.0 * ratio:.3g} | {1000 / ratio:,.0f} | {60 / ratio:.1f} | {60 / ratio:.1f} |" in ntp_row
  )
  assert "| 2.20x |" in sbd_row and f"| {4.4 * ratio:.3g} |" in sbd_row
  assert f"= {ratio:.2f}" in table
  bars = tpu_train_step.plot(results, str(tmp_path / "steps.png"))["estimated step (s)"]
  stacked = [sum(bars[part][1][i] for part in list(bars)[:3]) for i in range(2)]
  assert stacked == pytest.approx([2.0, 4.4]) and bars["MaxText measured"] == ([0], [3.44])


def test_a_case_estimated_without_memory_gets_it_from_a_rerun(tmp_path, monkeypatch):
  """A rerun without --nomemory compiles only the whole step of finished cases that lack their
  memory, keeps their estimates, and then compiles nothing more; a step too big is shown so."""
  from benchmarks import tpu_train_step as bench

  estimate = dict(
    step_s=2.0, xla_step_s=1.0, corrected_xla_step_s=1.5, splash_at_peak_s=0.5,
    tokens_per_s_per_chip=1000.0, mfu=0.5, processed_mfu=0.5,
  )  # fmt: skip
  cases = bench.cases(["calibration"], [], [])
  earlier = bench.cases(["recipe"], ["qwen3_8b"], ["v6e-256"])[:1]  # not asked for this time
  finished = [
    dict(case=c, estimate=estimate, batch_size=24, seq_len=8192, wall_s=1.0, fits=True)
    for c in cases + earlier
  ]
  finished[2].update(bytes_per_device={"total": 20 * 2**30}, hbm_per_device=32 * 2**30)
  (tmp_path / "results.json").write_text(json.dumps({"results": finished}))
  gib, compiled = 2**30, []

  def whole_step(case):
    compiled.append(case["name"])
    if case["objective"] == "sbd":
      return {"fits": False, "compiler_error": "out of memory", "hbm_per_device": 32 * gib}
    return {"bytes_per_device": {"total": 30 * gib}, "hbm_per_device": 32 * gib, "fits": True}

  monkeypatch.setattr(bench, "case_memory", whole_step)
  monkeypatch.setattr(bench, "run_case", lambda *a: pytest.fail("a finished case compiled again"))
  given = SimpleNamespace(
    out=str(tmp_path), cases=["calibration"], configs=[], slices=[], memory=True
  )
  monkeypatch.setattr(bench.flags, "FLAGS", given)
  bench.main([])
  bench.main([])
  assert compiled == [c["name"] for c in cases]
  saved = json.loads((tmp_path / "results.json").read_text())["results"]
  assert [r["case"]["name"] for r in saved] == [c["name"] for c in cases + earlier]
  assert [r["estimate"] for r in saved] == [estimate] * 3
  table = (tmp_path / "tpu_train_step.md").read_text().splitlines()
  assert table[2].endswith("| 30.0 / 32 |") and table[3].endswith("| does not fit |")
  assert table[4].startswith("| qwen3_8b | v6e-256 | NTP |")  # an earlier run's case stays
  assert table[4].endswith("| 20.0 / 32 |")
