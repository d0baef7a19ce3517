"""Parameter constructors that attach logical axis names from birth.

The names (e.g. ("vocab", "embed")) are metadata; `prism_jax.sharding`'s one rules table maps
them to mesh axes. Without an active mesh, parameters are created unsharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from prism_jax.sharding import constrain

Axes = tuple[str | None, ...]


def logical_param(value: jax.Array, axes: Axes) -> nnx.Param:
  # Flax's eager sharding would look the *logical* names up as mesh axes; instead the
  # value is constrained through the rules table (a no-op without a mesh).
  return nnx.Param(constrain(value, axes), out_sharding=axes, eager_sharding=False)


def normal_param(rngs: nnx.Rngs, shape, std: float, axes: Axes) -> nnx.Param:
  return logical_param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes)


def const_param(shape, value: float, axes: Axes) -> nnx.Param:
  return logical_param(jnp.full(shape, value, jnp.float32), axes)
