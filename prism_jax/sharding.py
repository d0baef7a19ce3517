"""Device mesh, the one logical-axis rules table, and sharding helpers.

Parameters carry logical axis names from birth (prism_jax.model.params); activations are
pinned with `constrain(x, logical_axes)`. This table is the only place that maps logical
names to mesh axes (maxtext's `logical_axis_rules`). Mesh axes:

  data   pure data parallelism (parameters replicated)
  fsdp   data parallelism with parameters/optimizer state sharded (ZeRO-3 style)
  model  tensor parallelism: vocab, heads, MLP width, and the prototype bank over K

A mesh axis that does not divide an array dimension is dropped for that array (the
dimension is replicated instead), so every preset runs on every mesh shape.
"""

from __future__ import annotations

import contextlib
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from prism_jax.config import MeshConfig

MESH_AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("norm", None),
    ("proto", "model"),
    # activations
    ("batch", BATCH_AXES),
    ("tokens", BATCH_AXES),  # N = B*T flattened tokens
    ("seq", None),
    ("act_embed", None),  # activations keep D whole; FSDP gathers weights instead
    ("act_vocab", "model"),
    ("act_heads", "model"),
    ("act_mlp", "model"),
)


def mesh_axes(logical: str) -> tuple[str, ...]:
  """The mesh axes LOGICAL_RULES maps a logical axis to (() = replicated): what the
  prototype op is told to split its tokens ("tokens") and its bank ("proto") over."""
  rules = dict(LOGICAL_RULES)
  if logical not in rules:
    raise ValueError(f"unknown logical axis {logical!r}; LOGICAL_RULES has {sorted(rules)}")
  entry = rules[logical]
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, model) sizes, with one -1 filled from the device count."""
  sizes = [cfg.data, cfg.fsdp, cfg.model]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh {tuple(sizes)} cannot be filled from {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh data*fsdp*model = {math.prod(sizes)} but there are "
                     f"{num_devices} devices; set one axis to -1 or match the count")
  return tuple(sizes)


def make_mesh(cfg: MeshConfig = MeshConfig(), devices=None) -> jax.sharding.Mesh:
  """The (data, fsdp, model) mesh over `devices` (default: all, every process)."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(cfg, len(devices))
  if devices == jax.devices():  # topology-aware device order (ICI rings on TPU)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=np.asarray(devices).reshape(-1))


def _mesh_sizes(mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def _fit(entry, dim: int | None, sizes: dict[str, int]):
  """Drop mesh axes (from the right) until their product divides `dim`."""
  if entry is None or dim is None:
    return entry
  axes = (entry,) if isinstance(entry, str) else tuple(entry)
  axes = tuple(a for a in axes if a in sizes)
  while axes and dim % math.prod(sizes[a] for a in axes):
    axes = axes[:-1]
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def logical_to_spec(axes, shape=None, mesh=None) -> P:
  """PartitionSpec for logical axis names; with `shape` and `mesh`, fitted to divide."""
  rules = dict(LOGICAL_RULES)
  for a in axes:
    if a is not None and a not in rules:
      raise ValueError(f"unknown logical axis {a!r}; add it to LOGICAL_RULES "
                       f"(known: {sorted(rules)})")
  spec = [None if a is None else rules[a] for a in axes]
  if shape is not None and mesh is not None:
    if len(shape) != len(spec):
      raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    sizes = _mesh_sizes(mesh)
    used: set[str] = set()
    fitted = []
    for entry, dim in zip(spec, shape):
      entry = _fit(entry, dim, sizes)
      names = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
      if used & set(names):  # a mesh axis may shard one dimension only
        entry, names = None, ()
      used |= set(names)
      fitted.append(entry)
    spec = fitted
  return P(*spec)


def param_shardings(graph_state, mesh: jax.sharding.Mesh):
  """NamedShardings for an nnx.State whose Variables carry `out_sharding` logical names.

  Works on abstract (eval_shape) or concrete state, including optimizer state whose
  variables inherit the parameters' metadata. Unnamed leaves are replicated.
  """
  def one(var):
    axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
    shape = getattr(var, "shape", None)
    spec = logical_to_spec(axes, shape, mesh) if axes and shape is not None else P()
    return NamedSharding(mesh, spec)
  return jax.tree.map(one, graph_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int = 2) -> NamedSharding:
  """Rows of a (B, T) (or (B,) with ndim=1) batch split over the data-parallel axes."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def constrain(x: jax.Array, logical_axes) -> jax.Array:
  """Pin an activation's sharding by logical names; a no-op without an (auto) mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
    return x  # no mesh, or inside shard_map / explicit-sharding code
  spec = logical_to_spec(logical_axes, x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, spec)


@contextlib.contextmanager
def no_mesh():
  """Trace without a context mesh, e.g. so parameter constructors do not eager-shard."""
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    yield


# ---------------------------------------------------------------- global batches


def _check_rows(mesh, global_rows: int) -> None:
  shards = math.prod(_mesh_sizes(mesh)[a] for a in BATCH_AXES)
  if global_rows % shards:
    raise ValueError(f"global batch of {global_rows} rows cannot be split over the mesh's "
                     f"data*fsdp = {shards} shards; use a multiple of {shards}")


def process_batch_slice(mesh: jax.sharding.Mesh, global_rows: int) -> tuple[int, int]:
  """(shard_index, shard_count) of this process's rows of a global batch.

  The global batch is split into `shard_count` equal contiguous row blocks, one per
  distinct set of rows that processes hold; this process needs block `shard_index`
  (processes holding replicas of the same rows, e.g. along `model`, get the same block).
  Feed these to the data loader (grain ShardOptions) instead of raw process ids.
  """
  _check_rows(mesh, global_rows)
  sharding = batch_sharding(mesh, 1)
  index_map = sharding.devices_indices_map((global_rows,))
  per_process: dict[int, set[tuple[int, int]]] = {}
  for device, (rows,) in index_map.items():
    start, stop, _ = rows.indices(global_rows)
    per_process.setdefault(device.process_index, set()).add((start, stop))
  spans = {}
  for proc, blocks in per_process.items():
    starts, stops = sorted(b[0] for b in blocks), sorted(b[1] for b in blocks)
    spans[proc] = (starts[0], stops[-1])
  distinct = sorted(set(spans.values()))
  size = distinct[0][1] - distinct[0][0]
  if any(b - a != size for a, b in distinct) or sum(b - a for a, b in distinct) != global_rows:
    raise ValueError(f"mesh {dict(_mesh_sizes(mesh))} does not split {global_rows} batch "
                     "rows into equal contiguous blocks per process")
  return distinct.index(spans[jax.process_index()]), len(distinct)


def make_global_batch(local_batch: dict[str, np.ndarray], mesh: jax.sharding.Mesh,
                      global_rows: int | None = None) -> dict[str, jax.Array]:
  """Global arrays, rows split over (data, fsdp), from this process's rows of the batch.

  `local_batch` holds this process's block (see `process_batch_slice`) of every array
  (first axis = rows); on one process that is the whole batch.
  """
  out = {}
  for name, value in local_batch.items():
    value = np.asarray(value)
    rows = global_rows
    if rows is None:  # local rows times the number of distinct row blocks
      rows = value.shape[0] * process_batch_slice(mesh, math.prod(
          _mesh_sizes(mesh)[a] for a in BATCH_AXES))[1]
    shape = (rows,) + value.shape[1:]
    _check_rows(mesh, rows)
    out[name] = jax.make_array_from_process_local_data(
        batch_sharding(mesh, value.ndim), value, shape)
  return out
