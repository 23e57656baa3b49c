"""How long a train step takes on a TPU slice, by XLA's TPU cost model plus the splash kernels'
FLOPs at the chips' peak, compiled ahead of time on a machine without a TPU.

Two things the cost model does not see, measured on libtpu's compiler (JAX 0.10):
- A scanned layer stack is one while loop, which `cost_analysis()` counts once (its FLOPs and
  its time). So the step is compiled unrolled with one and with two layers and every figure is
  extrapolated to the model's depth, v(L) = v(1) + (L - 1) (v(2) - v(1)): the layers of a
  straight-line program add up in the estimate.
- Sharded over a slice, the step's FLOPs as XLA counts them fall short of the matmuls the
  step runs (by about a third for the 8B step with fsdp), and its time estimate with them; the
  estimate is scaled by executed / counted matmul FLOPs (`executed_matmul_flops`).
- Splash attention runs as Mosaic kernels (custom calls) with no cost model: a layer's
  forward and backward kernels add nothing to `optimal_seconds` and no FLOPs. Their time is
  added here as the FLOPs they execute at the chip's bf16 peak: every (query tile, key tile)
  pair the kernel's static mask does not skip, forward (twice with rematerialisation) and the
  backward's dq and dkv kernels, which recompute the scores. At peak this part is a lower
  bound; the calibration against a measured step (BENCHMARKS.md) says how far the whole
  estimate is from a real one.
"""

from __future__ import annotations

import dataclasses
import statistics

from sbd_jax import config as config_lib
from sbd_jax.tpu import cost
from sbd_jax.tpu.programs import compile_train_step
from sbd_jax.training.metrics import flops_per_token

# Matmul FLOPs per (query tile, key tile) pair per query head, in units of tile^2 * head_dim:
# forward QK^T and PV; backward dkv kernel QK^T, dP, dV, dK and dq kernel QK^T, dP, dQ.
FORWARD_UNITS = 4
BACKWARD_UNITS = 14


@dataclasses.dataclass(frozen=True)
class StepCost:
  """XLA's cost model for one compiled step, per device."""

  seconds: float  # optimal_seconds, ops without a cost model taken back
  flops: float
  bytes_accessed: float

  @classmethod
  def of(cls, compiled, what: str) -> StepCost:
    analysis = cost.cost_analysis(compiled)
    return cls(
      cost.estimated_seconds(compiled, what),
      float(analysis.get("flops", 0.0)),
      float(analysis.get("bytes accessed", 0.0)),
    )

  def extrapolate(self, two_layers: StepCost, num_layers: int) -> StepCost:
    """`self` compiled with one layer, `two_layers` with two: the figures at `num_layers`."""
    at = lambda one, two: one + (num_layers - 1) * (two - one)  # noqa: E731
    return StepCost(
      at(self.seconds, two_layers.seconds),
      at(self.flops, two_layers.flops),
      at(self.bytes_accessed, two_layers.bytes_accessed),
    )


def splash_tile_pairs(length: int, tile: int, block_size: int) -> int:
  """(query tile, key tile) pairs a splash kernel computes over a row of `length` tokens:
  causal (block_size 0), or the SBD [clean ; block] row of 2L = `length` with blocks of
  `block_size`. A pair is skipped only when the static mask hides all of it."""
  from sbd_jax.attention import splash

  tile = min(tile, length)
  n = -(-length // tile)
  if not block_size:
    return n * (n + 1) // 2
  mask = splash.SBDMask(length // 2, block_size)
  pairs = 0
  for qi in range(n):
    q0, q1 = qi * tile, min((qi + 1) * tile, length)
    for ki in range(n):
      k0, k1 = ki * tile, min((ki + 1) * tile, length)
      pairs += mask._uniform_tile(q0, q1, k0, k1) is not False
  return pairs


def splash_seconds(c, mesh_shape: dict, peak_flops_per_device: float, ntp: bool) -> float:
  """The step's splash kernels at peak on one device: its rows and heads, every layer, the
  block sizes the run draws averaged (one kernel per k, `lax.switch`)."""
  model = config_lib.to_model_config(c)
  seq_len, tile = c.train.seq_len, model.attention_chunk
  if ntp:
    pairs = splash_tile_pairs(seq_len, tile, 0)
  else:
    sizes = range(c.sbd.k_min, c.sbd.k_max + 1)
    pairs = statistics.fmean(splash_tile_pairs(2 * seq_len, tile, k) for k in sizes)
  length = seq_len if ntp else 2 * seq_len
  t = min(tile, length)
  forwards = 1 if model.remat == "none" else 2  # rematerialised: the forward runs again
  units = forwards * FORWARD_UNITS + BACKWARD_UNITS
  rows = c.train.batch_size / (mesh_shape["data"] * mesh_shape["fsdp"])
  heads = model.num_heads / mesh_shape["tensor"]
  flops = model.num_layers * rows * heads * pairs * units * t * t * model.head_dim
  return flops / peak_flops_per_device


def model_flops(c, num_devices: int, n_params: int | None = None) -> dict:
  """Per device and step: the model FLOPs of the rows' L tokens (what an NTP step of the same
  rows does; MFU counts these) and the FLOPs of the tokens the step processes (2L for SBD)."""
  model = config_lib.to_model_config(c)
  if n_params is None:
    n_params = count_params_of(model)
  tokens = c.train.seq_len * c.train.batch_size / num_devices
  per_device = flops_per_token(model, n_params, c.train.seq_len) * tokens
  factor = 1 if c.sbd.mode == "ntp" else 2
  return {"model_flops_per_device": per_device, "flops_per_device": factor * per_device}


def count_params_of(model) -> int:
  """Parameters of a model config, from abstract shapes (nothing allocated)."""
  from flax import nnx

  from sbd_jax.model.transformer import Transformer, count_params

  return count_params(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))


# Layer matmuls a rematerialised layer runs again in the backward pass, by remat policy.
def _recomputed_params(remat: str, attention_params: int, mlp_params: int) -> int:
  return {"full": attention_params + mlp_params, "offload": mlp_params}.get(remat, 0)


def executed_matmul_flops(c, num_devices: int) -> float:
  """Per device and step: the FLOPs of the matmuls the step executes outside attention's score
  kernels (projections, MLP, output head): forward, backward (twice the forward), and the
  forward again of what rematerialisation recomputes."""
  m = config_lib.to_model_config(c)
  attention_params = m.embed_dim * (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
  mlp_params = 3 * m.embed_dim * m.mlp_dim
  recomputed = _recomputed_params(m.remat, attention_params, mlp_params)
  per_token = 6 * (m.num_layers * (attention_params + mlp_params) + m.vocab_size * m.embed_dim)
  per_token += 2 * m.num_layers * recomputed
  factor = 1 if c.sbd.mode == "ntp" else 2
  return per_token * factor * c.train.seq_len * c.train.batch_size / num_devices


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  seconds: float  # the estimate: corrected_xla_s + attention_s
  xla: StepCost  # the compiled step without the splash kernels, extrapolated to every layer
  corrected_xla_s: float  # xla.seconds scaled by the matmul FLOPs it does not count (see below)
  attention_s: float  # the splash kernels at peak (0 for dense attention, which XLA costs)
  compile_s: float


def estimate_train_step(
  c, devices, mesh_shape: dict, peak_flops_per_device: float, compiler_options=None
) -> StepEstimate:
  """Compile config `c`'s train step (its objective, `c.sbd.mode`) unrolled with one and two
  layers for `devices` and estimate the whole step's time per device. With splash attention the
  shallow steps draw a single k (k_max): XLA costs nothing in the kernels that depend on k."""
  model = config_lib.to_model_config(c)
  if model.attention_impl == "chunked":
    raise config_lib.ConfigError(
      "the TPU cost model counts chunked attention's loop over key chunks once; estimate the "
      "step with model.attention_impl=splash (the TPU kernel) or dense"
    )
  costs, compile_s = [], 0.0
  for layers in (1, 2):
    shallow = c.copy_and_resolve_references()
    shallow.model.update(num_layers=layers, scan_layers=False)
    if model.attention_impl == "splash":
      # One splash kernel per layer instead of one per k the run draws (15 for k ~ U{2..16},
      # each compiled): the kernels are uncosted, and splash_seconds averages the drawn k.
      shallow.sbd.k_min = shallow.sbd.k_max
    compiled, _, seconds = compile_train_step(shallow, devices, compiler_options)
    costs.append(StepCost.of(compiled, f"the train step with {layers} layer(s)"))
    compile_s += seconds
  xla = costs[0].extrapolate(costs[1], model.num_layers)
  attention_s, corrected = 0.0, xla.seconds
  if model.attention_impl == "splash":
    attention_s = splash_seconds(c, mesh_shape, peak_flops_per_device, c.sbd.mode == "ntp")
    # Sharded over a slice, XLA's FLOP count of the step falls short of the matmuls it runs
    # (0.63x for the 8B step with fsdp over a v6e-8; on one chip it matches the analytic count,
    # tests/test_aot.py): the time of the uncounted part is not in its estimate either. It is
    # added at the rate the counted FLOPs run at in the estimate.
    executed = executed_matmul_flops(c, len(devices))
    if 0 < xla.flops < executed:
      corrected = xla.seconds * executed / xla.flops
  return StepEstimate(corrected + attention_s, xla, corrected, attention_s, compile_s)
