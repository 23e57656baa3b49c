"""The train step on a simulated 2x2x2 mesh equals the single-device step; shardings are sane."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sbd_jax import config, sharding
from sbd_jax.model import architectures
from sbd_jax.sbd.objective import ObjectiveConfig
from sbd_jax.training.optim import make_optimizer
from sbd_jax.training.state import make_state_spec
from sbd_jax.training.step import make_train_step
from sbd_jax.training.trainer import global_batch

MODEL = architectures.tiny(
  num_layers=2,
  embed_dim=64,
  num_heads=4,
  num_kv_heads=2,
  head_dim=16,
  mlp_dim=128,
  vocab_size=264,
  attention_chunk=16,
)

# Golden partition specs of the tiny model on a (data, fsdp, tensor) mesh.
GOLDEN = {
  "embed/table_VD": ("tensor", "fsdp"),
  "blocks/0/attention/q_DNH": ("fsdp", "tensor", None),
  "blocks/0/attention/k_DKH": ("fsdp", "tensor", None),
  "blocks/0/attention/o_NHD": ("tensor", None, "fsdp"),
  "blocks/0/mlp/gate_DF": ("fsdp", "tensor"),
  "blocks/0/mlp/down_FD": ("tensor", "fsdp"),
  "blocks/0/attention_norm/scale": (None,),
  "final_norm/scale": (None,),
}


def run_steps(mesh, steps=2):
  optim = config.base_config().optim
  tx, _ = make_optimizer(optim, total_steps=10)
  spec = make_state_spec(MODEL, tx, mesh, seed=0)
  step_fn = make_train_step(spec, ObjectiveConfig(mask_id=259, k_min=2, k_max=8), mesh, seed=0)
  rng = np.random.default_rng(0)
  losses = []
  with sharding.activation_sharding(mesh):
    state = spec.init()
    for step in range(steps):
      local = {
        "tokens": rng.integers(0, 256, (8, 32)),
        "segment_ids": np.ones((8, 32)),
        "positions": np.tile(np.arange(32), (8, 1)),
        "loss_mask": np.ones((8, 32)),
      }
      state, metrics = step_fn(state, global_batch(local, mesh), jnp.asarray(step))
      losses.append(float(metrics["loss"]))
  return losses, state


@pytest.fixture(scope="module")
def runs():
  assert jax.device_count() == 8, "tests/conftest.py must provide 8 host devices"
  single = run_steps(sharding.make_mesh((1, 1, 1), jax.devices()[:1]))
  multi = run_steps(sharding.make_mesh((2, 2, 2)))
  return single, multi


def test_sharded_train_steps_equal_single_device(runs):
  (single_losses, single_state), (multi_losses, multi_state) = runs
  np.testing.assert_allclose(multi_losses, single_losses, rtol=2e-5)
  single_params = nnx.state(single_state["model"], nnx.Param)
  multi_params = nnx.state(multi_state["model"], nnx.Param)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), multi_params, single_params
  )


def test_no_large_parameter_or_optimizer_state_is_replicated(runs):
  _, (_, state) = runs
  for path, var in nnx.to_flat_state(state):
    array = var.get_value()
    if array.size >= 1024:
      assert not array.sharding.is_fully_replicated, "/".join(map(str, path))


def test_golden_partition_specs(runs):
  _, (_, state) = runs
  flat = {
    "/".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state["model"])
  }
  for name, spec in GOLDEN.items():
    assert tuple(flat[name].sharding.spec) == spec, name


def test_logical_rules_drop_axes_that_do_not_divide():
  mesh = sharding.make_mesh((2, 2, 2))
  assert sharding.logical_to_spec(
    ("embed", "mlp"), sharding.PARAM_RULES, mesh, (6, 5)
  ) == jax.sharding.PartitionSpec("fsdp", None)
  assert sharding.logical_to_spec(
    ("embed", "mlp"), sharding.SAMPLING_RULES, mesh, (8, 8)
  ) == jax.sharding.PartitionSpec(None, "tensor")


def test_mesh_shape_errors_are_one_line():
  with pytest.raises(ValueError, match=r"mesh shape \(3, 1, 1\) needs 3 devices, but 8"):
    sharding.make_mesh((3, 1, 1))
  assert dict(sharding.make_mesh((2, -1, 1)).shape) == {"data": 2, "fsdp": 4, "tensor": 1}


@pytest.mark.parametrize(
  "hosts, per_host, kv_heads, shape",
  [
    (1, 8, 8, (1, 1, 8)),  # v5e-8, Llama-3.1 8B: one host's chips hold the weights
    (1, 4, 8, (1, 1, 4)),  # v5p-8
    (4, 4, 8, (4, 1, 4)),  # v5p-32: rows over the hosts
    (1, 8, 2, (4, 1, 2)),  # a model with 2 KV heads: no chip holds part of a head
    (2, 6, 4, (6, 1, 2)),
    (1, 1, 8, (1, 1, 1)),
  ],
)
def test_decoding_splits_weights_within_a_host_and_rows_over_the_rest(
  hosts, per_host, kv_heads, shape
):
  Device = type("Device", (), {})
  devices = []
  for host in range(hosts):
    for _ in range(per_host):
      devices.append(Device())
      devices[-1].process_index = host
  assert sharding.decoding_mesh_shape(devices, kv_heads) == shape


def test_the_decoding_mesh_is_the_given_shape_or_the_decoding_layout():
  assert dict(sharding.decoding_mesh(jax.devices(), 2).shape) == {"data": 4, "fsdp": 1, "tensor": 2}
  given = sharding.decoding_mesh(jax.devices(), 2, (1, -1, 1))
  assert dict(given.shape) == {"data": 1, "fsdp": 8, "tensor": 1}


def test_a_state_around_given_params_is_built_sharded_without_a_random_init():
  """`init_from_params`: the given params, Adam state as a fresh init would have it, every
  leaf on its sharding; and its compiled program generates no random numbers (the random
  init traced around the params is dead code), while the fresh init's does."""
  mesh = sharding.make_mesh((2, 2, 2))
  tx, _ = make_optimizer(config.base_config().optim, total_steps=10)
  spec = make_state_spec(MODEL, tx, mesh, seed=0)
  fresh = spec.init()
  other = make_state_spec(MODEL, tx, mesh, seed=1).init()  # params a checkpoint would hold
  params = nnx.state(other["model"], nnx.Param)
  expected = jax.tree.map(np.asarray, params)
  state = spec.init_from_params(params)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(state["model"], nnx.Param), expected)
  jax.tree.map(np.testing.assert_array_equal, state["optimizer"], fresh["optimizer"])
  jax.tree.map(lambda x, s: assert_sharded_as(x, s), state, spec.shardings)

  def draws_random_bits(hlo):
    return "threefry" in hlo or "rng-bit-generator" in hlo

  assert draws_random_bits(spec.init.lower().compile().as_text())
  abstract_params = nnx.state(spec.abstract, nnx.Param)["model"]
  assert not draws_random_bits(spec.init_from_params.lower(abstract_params).compile().as_text())


def assert_sharded_as(x, s):
  assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
