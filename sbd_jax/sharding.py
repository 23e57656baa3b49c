"""Everything about device meshes and logical-axis sharding, in one place.

Layers only name logical axes ("embed", "mlp", "act_batch", ...). A rules table maps each
logical name to mesh axes of the (data, fsdp, tensor) mesh. Three tables:

* PARAM_RULES:    training parameters and optimizer state (FSDP over "embed", TP over heads/MLP).
* ACTIVATION_RULES: activations inside the model (batch over data x fsdp, TP inside blocks).
* SAMPLING_RULES: parameters for decoding: the same tensor parallelism, no FSDP (weights are
  replicated over data/fsdp so a forward never all-gathers them).

The NNX sharding API still moves between releases; keeping it behind these helpers means one
file to touch when it does.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
Rules = tuple[tuple[str, Any], ...]

PARAM_RULES: Rules = (
  ("layers", None),  # the stacked-layer axis of scanned models
  ("vocab", "tensor"),
  ("embed", "fsdp"),
  ("mlp", "tensor"),
  ("q_heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("norm", None),
)
ACTIVATION_RULES: Rules = (
  ("act_batch", ("data", "fsdp")),
  ("act_length", None),
  ("act_embed", None),
  ("act_heads", "tensor"),
  ("act_kv_heads", "tensor"),
  ("act_mlp", "tensor"),
  ("act_vocab", "tensor"),
)
SAMPLING_RULES: Rules = tuple(
  (name, None if name == "embed" else axes) for name, axes in PARAM_RULES
)


def make_mesh(
  shape: Sequence[int],
  devices: Sequence[jax.Device] | None = None,
  dcn_shape: Sequence[int] | None = None,
) -> Mesh:
  """A (data, fsdp, tensor) mesh; one entry of `shape` may be -1 (use the remaining devices).

  `jax.make_mesh` orders the devices so that the inner mesh axes run over physical neighbours
  on a TPU slice; on other devices (and grids it cannot map) the order is the list's. Devices
  of several slices (multislice: `slice_index` differs) get a hybrid mesh: `dcn_shape` says
  how many slices each axis spans (default: all of them on `data`, whose gradient all-reduce
  is the one collective per step that tolerates the slower data-centre network), and each
  slice holds `shape / dcn_shape` of the mesh, laid out over its ICI links."""
  devices = list(jax.devices() if devices is None else devices)
  shape = list(shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f"mesh shape {tuple(shape)} must have 3 entries for axes {MESH_AXES}")
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f"mesh shape {tuple(shape)}: sizes must be positive, at most one -1")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if len(devices) % known:
      raise ValueError(f"mesh shape {tuple(shape)} does not divide {len(devices)} devices")
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ValueError(
      f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, "
      f"but {len(devices)} are available"
    )
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1 or (dcn_shape is not None and math.prod(dcn_shape) > 1):
    return _multislice_mesh(shape, devices, slices, dcn_shape)
  try:  # devices ordered by their physical (ICI) topology on TPU slices
    return jax.make_mesh(
      shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
    )
  except (ValueError, NotImplementedError, AssertionError):  # a grid it cannot map: list order
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def _multislice_mesh(
  shape: Sequence[int], devices: Sequence[jax.Device], slices: int, dcn_shape: Sequence[int] | None
) -> Mesh:
  dcn = list(dcn_shape) if dcn_shape is not None else [slices, 1, 1]
  if len(dcn) != len(MESH_AXES) or any(d < 1 for d in dcn) or math.prod(dcn) != slices:
    raise ValueError(
      f"mesh.dcn_shape {tuple(dcn)} must be 3 positive sizes whose product is the number of "
      f"slices the devices form ({slices})"
    )
  if any(s % d for s, d in zip(shape, dcn)):
    raise ValueError(f"mesh shape {tuple(shape)} is not divisible by mesh.dcn_shape {tuple(dcn)}")
  per_slice = [s // d for s, d in zip(shape, dcn)]
  grid = mesh_utils.create_hybrid_device_mesh(per_slice, dcn, devices)
  return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def mesh_from_config(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """`make_mesh` from a config's `mesh` block (`shape`, and `dcn_shape` for multislice)."""
  dcn_shape = tuple(mesh_cfg.dcn_shape)
  return make_mesh(mesh_cfg.shape, devices, dcn_shape if math.prod(dcn_shape) > 1 else None)


def decoding_mesh_shape(devices: Sequence[jax.Device], num_kv_heads: int) -> tuple[int, int, int]:
  """(data, 1, tensor) for decoding: the weights split tensor-parallel over the chips of one
  host (as many as divide the KV heads, so each holds whole heads of the cache), the rows over
  the rest. Training's fsdp would gather the weights again at every forward of a decode."""
  host = devices[0].process_index
  per_host = sum(d.process_index == host for d in devices)
  tensor = max(t for t in range(1, per_host + 1) if per_host % t == 0 and num_kv_heads % t == 0)
  return (len(devices) // tensor, 1, tensor)


def decoding_mesh(
  devices: Sequence[jax.Device], num_kv_heads: int, shape: Sequence[int] = ()
) -> Mesh:
  """The mesh a decode runs on: `shape` (data, fsdp, tensor) when given, else
  `decoding_mesh_shape`'s."""
  devices = list(devices)
  return make_mesh(shape or decoding_mesh_shape(devices, num_kv_heads), devices)


def logical_to_spec(
  axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
  """Map logical axis names to a PartitionSpec.

  A mesh axis is dropped (the dimension stays replicated along it) when the dimension is not
  divisible by the mesh axis size, or when an earlier dimension already uses that mesh axis.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for i, name in enumerate(axes):
    mesh_axes = table.get(name) if name is not None else None
    if mesh_axes is None:
      spec.append(None)
      continue
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    kept = []
    for mesh_axis in mesh_axes:
      size = mesh.shape[mesh_axis]
      dim_left = None if shape is None else shape[i] // math.prod(mesh.shape[a] for a in kept)
      if mesh_axis in used or (dim_left is not None and dim_left % size):
        continue
      kept.append(mesh_axis)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def _logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
  return variable.get_metadata().get("out_sharding")


def state_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for every array of an nnx.State (or any pytree of Variables / arrays).

  Variables with logical axes are sharded by `rules`; everything else (step counters, scalars,
  RNG keys) is replicated.
  """

  def one(x):
    if isinstance(x, nnx.Variable):
      axes = _logical_axes(x)
      value = x.get_value()
      if axes is None or not hasattr(value, "shape") or len(axes) != len(value.shape):
        return x.replace(NamedSharding(mesh, PartitionSpec()))
      return x.replace(NamedSharding(mesh, logical_to_spec(axes, rules, mesh, value.shape)))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# Activation constraints --------------------------------------------------------------------

_ACTIVATION_CONTEXT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
  "sbd_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules = ACTIVATION_RULES) -> Iterator[None]:
  """Within this context (at trace time), `constrain` pins activations to the mesh."""
  token = _ACTIVATION_CONTEXT.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_CONTEXT.reset(token)


def current_activation_sharding() -> tuple[Mesh, Rules] | None:
  """The (mesh, rules) of the enclosing `activation_sharding`, or None outside one."""
  return _ACTIVATION_CONTEXT.get()


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op outside `activation_sharding`."""
  context = _ACTIVATION_CONTEXT.get()
  if context is None:
    return x
  mesh, rules = context
  spec = logical_to_spec(axes, rules, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def with_shardings(abstract: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs that carry their shardings (what `jit(f).lower` takes for arguments)."""
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Data batches: leading dimension over (data, fsdp), the rest replicated."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def row_shards(mesh: Mesh | None) -> int:
  """How many ways `batch_sharding` splits a batch's rows: data x fsdp (1 without a mesh)."""
  return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def batch_row_slices(mesh: Mesh, batch_size: int) -> list[int]:
  """The row slices of a batch this process's devices hold, in row order. `batch_sharding`
  cuts a batch into `row_shards(mesh)` slices of batch_size / row_shards rows; processes
  whose devices hold the same slice (the tensor axis across hosts, say) hold it alike, and
  must feed it the same rows."""
  rows = batch_size // row_shards(mesh)
  indices = batch_sharding(mesh).addressable_devices_indices_map((batch_size, 1)).values()
  return sorted({(index[0].start or 0) // rows for index in indices})


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def device_memory_bytes() -> int:
  """Memory of one device: the runtime's limit on accelerators, physical memory on the CPU."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
