"""Device mesh, the one logical-axis rules table, and sharding helpers.

Parameters carry logical axis names from birth (prism_jax.model.params); this table is the
only place that maps them to mesh axes (maxtext's `logical_axis_rules`).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from prism_jax.config import MeshConfig

MESH_AXES = ("data", "fsdp", "model")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("norm", None),
    ("proto", "model"),
)


def resolve_mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
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
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(cfg, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=np.asarray(devices).reshape(-1))


def logical_to_spec(axes) -> P:
  rules = dict(LOGICAL_RULES)
  return P(*[None if a is None else rules.get(a) for a in axes])


def param_shardings(graph_state, mesh: jax.sharding.Mesh):
  """NamedShardings for an nnx.State whose Variables carry `out_sharding` logical names."""
  def one(var):
    axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
    spec = logical_to_spec(axes) if axes else P()
    return NamedSharding(mesh, spec)
  return jax.tree.map(one, graph_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Rows of a (B, T) batch split over the data-parallel axes."""
  return NamedSharding(mesh, logical_to_spec(("batch", None)))
