"""Parameter constructors that attach logical axis names from birth.

The names (e.g. ("vocab", "embed")) are metadata; `prism_jax.sharding`'s one rules table maps
them to mesh axes. Without an active mesh, parameters are created unsharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Axes = tuple[str | None, ...]


def _mesh_active() -> bool:
  return not jax.sharding.get_abstract_mesh().empty


def logical_param(value: jax.Array, axes: Axes) -> nnx.Param:
  return nnx.Param(value, out_sharding=axes, eager_sharding=_mesh_active())


def normal_param(rngs: nnx.Rngs, shape, std: float, axes: Axes) -> nnx.Param:
  return logical_param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes)


def const_param(shape, value: float, axes: Axes) -> nnx.Param:
  return logical_param(jnp.full(shape, value, jnp.float32), axes)
