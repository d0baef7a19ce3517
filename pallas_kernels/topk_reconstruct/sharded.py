"""Running the kernel on a mesh: tokens split over the data axes, the bank replicated.

Pallas kernels are opaque to XLA's SPMD partitioner, so under an active mesh
(`jax.set_mesh`) whose token axes ("data", "fsdp") are larger than one, the kernel runs
per device inside `jax.shard_map` on its n = N / shards tokens. Row outputs stay sharded;
the per-prototype statistics (R1 needs the minimum over the *global* batch) are reduced
over the token axes with a gathered max/min, which is differentiable (lax.pmax is not).
A bank sharded over a `model` axis is prism_jax.model.sharded_prototypes' job; inside a
caller's own shard_map (Manual axes) the kernel runs as is on the local tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

TOKEN_AXES = ("data", "fsdp")


def token_axes(num_tokens: int) -> tuple[str, ...]:
  """Mesh axes to split the N tokens over (empty: run the kernel unsharded)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if any(t == AxisType.Manual for t in types.values()):
    return ()  # already inside shard_map: the caller owns the cross-shard reductions
  axes = tuple(a for a in TOKEN_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  while axes and num_tokens % math.prod(mesh.shape[a] for a in axes):
    axes = axes[:-1]
  return axes


def _gather_best(x_K, axes, largest: bool):
  g = jax.lax.all_gather(x_K, axes, axis=0, tiled=False)
  return jnp.max(g, axis=0) if largest else jnp.min(g, axis=0)


def shard_stats(stats_fn, z_NxD, p_KxD, valid_N, axes: tuple[str, ...], sqeuclid: bool):
  """`stats_fn(z, p, valid)` (the custom_vjp kernel statistics) per token shard.

  Returns (sim, idx, col_max_cos[, row_min_sq, col_min_sq]) with the column statistics
  reduced over `axes`; the arg outputs stay local (only the backward uses them).
  """
  rows, rows2 = P(axes), P(axes, None)

  def body(z, p, valid):
    out = stats_fn(z, p, valid)
    res = (out[0], out[1], _gather_best(out[2], axes, True))
    if sqeuclid:
      res += (out[4], _gather_best(out[6], axes, False))
    return res

  out_specs = (rows2, rows2, P()) + ((rows, P()) if sqeuclid else ())
  # check_vma=False: the kernel body mixes token-varying and replicated operands, which
  # the Pallas interpreter's vma check rejects. Without it shard_map's transpose psums the
  # replicated bank's cotangent over the shards and splits the replicated outputs'
  # cotangents, which is exact here since the gathered column statistics are replicated.
  fn = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                     in_specs=(rows2, P(), rows), out_specs=out_specs, check_vma=False)
  return fn(z_NxD, p_KxD, valid_N)
