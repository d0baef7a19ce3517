"""The op on a mesh: tokens split over data axes, and optionally the bank split over K.

Mesh axis names come from the caller (prism_jax.sharding's rules table): `token_axes` for
the N tokens, `model_axis` for the K prototypes. Nothing here knows a mesh's naming.

Token-sharded kernel (`per_token_shard`, used by api.run_with_options). Pallas kernels are
opaque to XLA's SPMD partitioner, so under an active mesh (`jax.set_mesh`) whose token axes
are larger than one, the kernel runs per device inside `jax.shard_map` on its
n = N / shards tokens. Row outputs stay sharded; the per-prototype statistics (R1 needs
the minimum over the *global* batch) are reduced over the token axes with a gathered
max/min, which is differentiable (lax.pmax is not). Inside a caller's own shard_map
(Manual axes) the kernel runs as is on the local tokens.

K-sharded bank (`topk_reconstruct_sharded`). With m = size of the model axis and the
tokens split over the token axes (n per shard), each device holds z (n x D) and its K/m
prototypes, and:

  1. computes its n x (K/m) cosine similarities and their local top-k (values, global ids);
  2. all-gathers the k*m candidates over the model axis and takes the global top-k from
     them (ties go to the lower prototype id, as in the unsharded layer);
  3. rebuilds z_hat from the owning shards: each adds the active prototypes it holds and
     a psum over the model axis completes the sum;
  4. reduces the row statistics over the model axis (n x m gathered values) and the
     per-prototype column statistics over the token axes, so R1's minimum over tokens
     covers the whole global batch.

No device ever holds or receives the N x K matrix: per step the collectives move
O(N*k*m + N*D + K*data) values (forward and backward), independent of N*K. Reductions whose
gradient matters use `all_gather(to="invarying")` followed by a local max/min, because
`lax.pmax`/`pmin` have no differentiation rule. With kernel options (`opts`, a Pallas
implementation) step 1 and the local row/column statistics come from the fused kernel with
its sparse custom_vjp (vjp.stats), so not even the n x (K/m) block is materialised; the
merge, z_hat (vjp.gather_mix) and the reductions are the same plain JAX.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from pallas_kernels.topk_reconstruct import vjp
from pallas_kernels.topk_reconstruct.reference import (TopKReconstruction, first_max, first_min,
                                                       mixture_weights, similarity)


def _manual(mesh, axis: str) -> bool:
  return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Manual


def active_axes(axes: tuple[str, ...], num_tokens: int) -> tuple[str, ...]:
  """Those of `axes` the active mesh splits (size > 1), all of them when they divide N,
  else fewer; empty without a mesh or inside shard_map (the caller owns the reductions)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(t == AxisType.Manual for t in mesh.axis_types):
    return ()
  return _splitting(mesh, axes, num_tokens)


def _splitting(mesh, axes: tuple[str, ...], num_tokens: int) -> tuple[str, ...]:
  axes = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
  while axes and num_tokens % math.prod(mesh.shape[a] for a in axes):
    axes = axes[:-1]
  return axes


def _gather_best(x_K, axes, largest: bool):
  """The best of the shards' column statistics, its gradient on the first best shard (the
  lowest token id on exact ties across shards, as first_max; jnp.max would split it)."""
  g = jax.lax.all_gather(x_K, axes, axis=0, tiled=False)
  return first_max(g, 0) if largest else first_min(g, 0)


def per_token_shard(layer_fn, z_NxD, p_KxD, valid_N, axes: tuple[str, ...], sqeuclid: bool):
  """`layer_fn(z, p, valid)` (vjp.layer: statistics, act, z_hat under one custom_vjp) per
  token shard: the unsharded layer's composition, with the column statistics reduced over
  `axes`. Returns (stats, act, z_hat) with stats (sim, idx, col_max_cos, None[,
  row_min_sq, None, col_min_sq, None]): the arg outputs stay inside (the backward's)."""
  rows, rows2 = P(axes), P(axes, None)

  def body(z, p, valid):
    out, act, z_hat = layer_fn(z, p, valid)
    res = (out[0], out[1], _gather_best(out[2], axes, True))
    if sqeuclid:
      res += (out[4], _gather_best(out[6], axes, False))
    return res, act, z_hat

  out_specs = ((rows2, rows2, P()) + ((rows, P()) if sqeuclid else ()), rows2, rows2)
  # check_vma=False: the kernel body mixes token-varying and replicated operands, which
  # the Pallas interpreter's vma check rejects. Without it shard_map's transpose psums the
  # replicated bank's cotangent over the shards and splits the replicated outputs'
  # cotangents, which is exact here since the gathered column statistics are replicated.
  fn = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                     in_specs=(rows2, P(), rows), out_specs=out_specs, check_vma=False)
  out, act, z_hat = fn(z_NxD, p_KxD, valid_N)
  out = out[:3] + ((None, out[3], None, out[4]) if sqeuclid else (None,))
  return out, act, z_hat


def model_shards(model_axis: str) -> int:
  """Size of the active mesh's `model_axis` (1 without a mesh or inside shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or model_axis not in mesh.axis_names or _manual(mesh, model_axis):
    return 1
  return mesh.shape[model_axis]


def use_sharded(num_protos: int, model_axis: str) -> bool:
  """True when the bank should take the K-sharded path on the active mesh."""
  m = model_shards(model_axis)
  if m <= 1:
    return False
  if num_protos % m:
    raise ValueError(f"K={num_protos} prototypes cannot be sharded over the mesh's "
                     f"model axis of size {m}: K must be divisible by it")
  return True


def _gather_max(x, axes, axis):
  """Max over shards of `axes` (differentiable, invariant result) along array `axis`.
  Shards are gathered in order, so ties go to the lowest shard, i.e. the lowest id, as in
  the unsharded layer (first_max)."""
  if not axes:
    return x
  return first_max(jax.lax.all_gather(x, axes, axis=axis, tiled=False, to="invarying"),
                   axis)


def _gather_min(x, axes, axis):
  return -_gather_max(-x, axes, axis)


def _merge_candidates(vals_nxkl, gid_nxkl, k: int, mixture: str, model_axis: str):
  """Global top-k among the k*m candidates gathered over the model axis, and activations.

  Candidates are ordered by shard, then by (value desc, id asc), so on ties top_k keeps
  the lower prototype id, as in the unsharded layer.
  """
  cand_vals = jax.lax.all_gather(vals_nxkl, model_axis, axis=1, tiled=True, to="invarying")
  cand_ids = jax.lax.all_gather(gid_nxkl, model_axis, axis=1, tiled=True, to="invarying")
  sim_nxk, pos_nxk = jax.lax.top_k(cand_vals, k)
  idx_nxk = jnp.take_along_axis(cand_ids, pos_nxk, axis=1)
  return sim_nxk, idx_nxk, mixture_weights(sim_nxk, mixture)


def _owned(idx_nxk, offset, num_local: int):
  """Local row of each active prototype and whether this shard holds it."""
  local_nxk = idx_nxk - offset
  return jnp.clip(local_nxk, 0, num_local - 1), (local_nxk >= 0) & (local_nxk < num_local)


def _local_kernel(z_nxD, protos_KmxD, mask_n, *, k, mixture, distance, token_axes,
                  model_axis, opts):
  """Per-device body with the similarity, top-k and statistics from the kernel."""
  # Runs under shard_map(check_vma=False): the Pallas interpreter rejects operands of
  # mixed varying axes. shard_map's transpose then psums the cotangents of inputs it does
  # not split over an axis (dz over the model axis, dprotos over the token axes) and
  # splits those of outputs replicated over an axis; both are exact here because every
  # replicated output is computed identically on each shard (all_gather / psum results).
  num_local = protos_KmxD.shape[0]
  offset = (jax.lax.axis_index(model_axis) * num_local).astype(jnp.int32)
  out = vjp.stats(z_nxD, protos_KmxD, mask_n.astype(jnp.float32), min(k, num_local), opts)
  sim_nxk, idx_nxk, act_nxk = _merge_candidates(out[0], out[1] + offset, k, mixture,
                                                model_axis)
  local_nxk, owned_nxk = _owned(idx_nxk, offset, num_local)
  z_hat_part = vjp.gather_mix(jnp.where(owned_nxk, act_nxk, 0.0), local_nxk,  # float32
                              protos_KmxD, vjp.sequential(opts))
  z_hat_nxD = jax.lax.psum(z_hat_part, model_axis)
  row_max_cos_n = sim_nxk[:, 0]
  # The kernel's column statistics cover this shard's tokens: reduce over token shards.
  col_max_cos_Km = _gather_max(out[2], token_axes, 0)
  if distance == "cosine":
    row_min_dist_n, col_min_dist_Km = 1.0 - row_max_cos_n, 1.0 - col_max_cos_Km
  else:
    row_min_dist_n = _gather_min(out[4], (model_axis,), 1)
    col_min_dist_Km = _gather_min(out[6], token_axes, 0)
  return (idx_nxk, act_nxk, sim_nxk, z_hat_nxD, row_max_cos_n, col_max_cos_Km,
          row_min_dist_n, col_min_dist_Km)


def _local_layer(z_nxD, protos_KmxD, mask_n, *, k, mixture, distance, token_axes,
                 model_axis):
  """Per-device body of the sharded layer (inside shard_map), XLA implementation."""
  z = z_nxD.astype(jnp.float32)
  p = protos_KmxD.astype(jnp.float32)
  num_local = p.shape[0]
  offset = jax.lax.axis_index(model_axis) * num_local
  s = similarity(z, p)
  cos_nxKm = s.cos_NxK

  # Local top-k, then the global top-k among the k*m gathered candidates.
  vals_nxkl, lidx_nxkl = jax.lax.top_k(cos_nxKm, min(k, num_local))
  gid_nxkl = lidx_nxkl.astype(jnp.int32) + offset.astype(jnp.int32)
  sim_nxk, idx_nxk, act_nxk = _merge_candidates(vals_nxkl, gid_nxkl, k, mixture, model_axis)
  # Reconstruction from the owning shards.
  local_nxk, owned_nxk = _owned(idx_nxk, offset, num_local)
  z_hat_part = jnp.einsum("nk,nkd->nd", jnp.where(owned_nxk, act_nxk, 0.0), p[local_nxk],
                          precision=jax.lax.Precision.HIGHEST)
  z_hat_nxD = jax.lax.psum(z_hat_part, model_axis)

  row_max_cos_n = sim_nxk[:, 0]  # the global top-1 is the row maximum
  col_max_cos_Km = _gather_max(
      first_max(jnp.where(mask_n[:, None], cos_nxKm, -jnp.inf), 0), token_axes, 0)
  if distance == "cosine":
    row_min_dist_n, col_min_dist_Km = 1.0 - row_max_cos_n, 1.0 - col_max_cos_Km
  else:
    sqdist_nxKm = s.sqdist()
    row_min_dist_n = _gather_min(first_min(sqdist_nxKm, -1), (model_axis,), 1)
    col_min_dist_Km = _gather_min(
        first_min(jnp.where(mask_n[:, None], sqdist_nxKm, jnp.inf), 0), token_axes, 0)
  return (idx_nxk, act_nxk, sim_nxk, z_hat_nxD, row_max_cos_n, col_max_cos_Km,
          row_min_dist_n, col_min_dist_Km)


def topk_reconstruct_sharded(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                             model_axis: str, token_axes: tuple[str, ...],
                             mixture: str = "raw", distance: str = "cosine",
                             mask_N: jax.Array | None = None, opts=None):
  """Same contract and outputs as `topk_reconstruct_xla`, on the active mesh.

  Needs a mesh (jax.set_mesh) whose `model_axis` divides K. `opts` (api.KernelOptions):
  the per-shard similarity, top-k and statistics run in the fused kernel; None: in XLA.
  """
  mesh = jax.sharding.get_abstract_mesh()
  num_tokens, num_protos = z_NxD.shape[0], protos_KxD.shape[0]
  if mesh.empty or model_axis not in mesh.axis_names:
    raise ValueError(f"topk_reconstruct_sharded needs an active mesh with a {model_axis!r} "
                     "axis (use `with jax.set_mesh(mesh):`)")
  if num_protos % mesh.shape[model_axis]:
    raise ValueError(f"K={num_protos} is not divisible by the model axis "
                     f"({mesh.shape[model_axis]})")
  tok = _splitting(mesh, token_axes, num_tokens)
  tok_spec = tok if tok else None
  row, rows2, col = P(tok_spec), P(tok_spec, None), P(model_axis)
  kw = dict(k=k, mixture=mixture, distance=distance, token_axes=tok, model_axis=model_axis)

  def body(z, p, mask):
    if opts is not None:
      return _local_kernel(z, p, mask, opts=opts, **kw)
    return _local_layer(z, p, mask, **kw)

  mask = jnp.ones(num_tokens, bool) if mask_N is None else mask_N.astype(bool)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(rows2, P(model_axis, None), row),
                     out_specs=(rows2, rows2, rows2, rows2, row, col, row, col),
                     check_vma=opts is None)
  return TopKReconstruction(*fn(z_NxD, protos_KxD, mask))
