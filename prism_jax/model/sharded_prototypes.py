"""The prototype layer with the bank sharded over K on the `model` mesh axis.

With m = size of the `model` axis and the N tokens split over the data axes (n per shard),
each device holds z (n x D) and its K/m prototypes, and:

  1. computes its n x (K/m) cosine similarities and their local top-k (values, global ids);
  2. all-gathers the k*m candidates over `model` and takes the global top-k from them
     (ties go to the lower prototype id, as in the unsharded layer);
  3. rebuilds z_hat from the owning shards: each adds the active prototypes it holds and
     a psum over `model` completes the sum;
  4. reduces the row statistics over `model` (n x m gathered values) and the per-prototype
     column statistics over the data axes (K/m x data-shard gathered values), so R1's
     minimum over tokens covers the whole global batch.

No device ever holds or receives the N x K matrix: per step the collectives move
O(N*k*m + N*D + K*data) values (forward and backward), independent of N*K.

Reductions whose gradient matters use `all_gather(to="invarying")` followed by a local
max/min, because `lax.pmax`/`pmin` have no differentiation rule.

With a Pallas `implementation` (or None on TPU/GPU) step 1 and the local row/column
statistics come from the fused kernel (pallas_kernels.topk_reconstruct), so not even the
n x (K/m) block is materialised; its sparse custom_vjp supplies their gradients, and the
merge, z_hat (sparse `gather_mix`) and the reductions are the same plain JAX.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from prism_jax.model.prototypes import first_max, first_min, mixture_weights, similarity

MODEL_AXIS = "model"
TOKEN_AXES = ("data", "fsdp")


def model_shards() -> int:
  """Size of the active mesh's `model` axis (1 without a mesh or inside shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or MODEL_AXIS not in mesh.axis_names:
    return 1
  if dict(zip(mesh.axis_names, mesh.axis_types))[MODEL_AXIS] == AxisType.Manual:
    return 1  # already inside a shard_map over `model`: the caller handles it
  return mesh.shape[MODEL_AXIS]


def use_sharded(num_protos: int) -> bool:
  """True when `prototype_layer` should take the K-sharded path on the active mesh."""
  m = model_shards()
  if m <= 1:
    return False
  if num_protos % m:
    raise ValueError(f"K={num_protos} prototypes cannot be sharded over the mesh's "
                     f"model axis of size {m}: K must be divisible by it")
  return True


def _token_axes(mesh, num_tokens: int) -> tuple[str, ...]:
  """Data axes the N tokens are split over: all of them when they divide N, else fewer."""
  axes = tuple(a for a in TOKEN_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  while axes and num_tokens % math.prod(mesh.shape[a] for a in axes):
    axes = axes[:-1]
  return axes


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


def _kernel_opts(implementation: str | None, distance: str):
  """Kernel options when `implementation` resolves to a Pallas kernel, else None (XLA)."""
  try:
    from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
  except ImportError:
    if implementation in (None, "xla"):
      return None
    raise
  impl = api.resolve_implementation(implementation)
  if impl == "xla":
    return None
  return api.KernelOptions(distance=distance, backend="gpu" if impl == "pallas_gpu" else "tpu",
                           interpret=impl == "pallas_interpret")


def _local_kernel(z_nxD, protos_KmxD, mask_n, *, k: int, mixture: str, distance: str,
                  token_axes: tuple[str, ...], opts):
  """`_local_layer` with the per-shard similarity, top-k and statistics from the kernel."""
  from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
  # Runs under shard_map(check_vma=False): the Pallas interpreter rejects operands of
  # mixed varying axes. shard_map's transpose then psums the cotangents of inputs it does
  # not split over an axis (dz over `model`, dprotos over the token axes) and splits those
  # of outputs replicated over an axis; both are exact here because every replicated
  # output is computed identically on each shard (all_gather / psum results).
  z, p_in, valid_n = z_nxD, protos_KmxD, mask_n.astype(jnp.float32)
  num_local = p_in.shape[0]
  offset = (jax.lax.axis_index(MODEL_AXIS) * num_local).astype(jnp.int32)
  k_local = min(k, num_local)
  out = api._stats(z, p_in, valid_n, k_local, opts)  # pylint: disable=protected-access
  vals_nxkl, lidx_nxkl, col_max_cos_Km = out[0], out[1], out[2]
  gid_nxkl = lidx_nxkl + offset
  sim_nxk, idx_nxk, act_nxk = _merge_candidates(vals_nxkl, gid_nxkl, k, mixture)
  local_nxk = idx_nxk - offset
  owned_nxk = (local_nxk >= 0) & (local_nxk < num_local)
  z_hat_part = api.gather_mix(jnp.where(owned_nxk, act_nxk, 0.0),  # float32 (api._mix)
                              jnp.clip(local_nxk, 0, num_local - 1), p_in,
                              opts.backend == "tpu")
  z_hat_nxD = jax.lax.psum(z_hat_part, MODEL_AXIS)
  row_max_cos_n = sim_nxk[:, 0]
  # The kernel's column statistics cover this shard's tokens: reduce over token shards.
  col_max_cos_Km = _gather_max(col_max_cos_Km, token_axes, 0)
  if distance == "cosine":
    row_min_dist_n = 1.0 - row_max_cos_n
    col_min_dist_Km = 1.0 - col_max_cos_Km
  else:
    row_min_dist_n = _gather_min(out[4], (MODEL_AXIS,), 1)
    col_min_dist_Km = _gather_min(out[6], token_axes, 0)
  return (idx_nxk, act_nxk, sim_nxk, z_hat_nxD, row_max_cos_n, col_max_cos_Km,
          row_min_dist_n, col_min_dist_Km)


def _merge_candidates(vals_nxkl, gid_nxkl, k: int, mixture: str):
  """Global top-k among the k*m candidates gathered over `model`, and the activations.

  Candidates are ordered by shard, then by (value desc, id asc), so on ties top_k keeps
  the lower prototype id, as in the unsharded layer.
  """
  cand_vals = jax.lax.all_gather(vals_nxkl, MODEL_AXIS, axis=1, tiled=True, to="invarying")
  cand_ids = jax.lax.all_gather(gid_nxkl, MODEL_AXIS, axis=1, tiled=True, to="invarying")
  sim_nxk, pos_nxk = jax.lax.top_k(cand_vals, k)
  idx_nxk = jnp.take_along_axis(cand_ids, pos_nxk, axis=1)
  return sim_nxk, idx_nxk, mixture_weights(sim_nxk, mixture)


def _local_layer(z_nxD, protos_KmxD, mask_n, *, k: int, mixture: str, distance: str,
                 token_axes: tuple[str, ...]):
  """Per-device body of the sharded layer (inside shard_map), XLA implementation."""
  hi = jax.lax.Precision.HIGHEST
  z = z_nxD.astype(jnp.float32)
  p = protos_KmxD.astype(jnp.float32)
  num_local = p.shape[0]
  offset = jax.lax.axis_index(MODEL_AXIS) * num_local
  s = similarity(z, p)
  cos_nxKm = s.cos_NxK

  # Local top-k, then the global top-k among the k*m gathered candidates. Candidates are
  # ordered by shard, then by (value desc, id asc), so on ties top_k keeps the lower id.
  k_local = min(k, num_local)
  vals_nxkl, lidx_nxkl = jax.lax.top_k(cos_nxKm, k_local)
  gid_nxkl = lidx_nxkl.astype(jnp.int32) + offset.astype(jnp.int32)
  sim_nxk, idx_nxk, act_nxk = _merge_candidates(vals_nxkl, gid_nxkl, k, mixture)
  # Reconstruction from the owning shards.
  local_nxk = idx_nxk - offset
  owned_nxk = (local_nxk >= 0) & (local_nxk < num_local)
  p_nxkxD = p[jnp.clip(local_nxk, 0, num_local - 1)]
  z_hat_part = jnp.einsum("nk,nkd->nd", jnp.where(owned_nxk, act_nxk, 0.0), p_nxkxD,
                          precision=hi)
  z_hat_nxD = jax.lax.psum(z_hat_part, MODEL_AXIS)

  valid_n = mask_n
  row_max_cos_n = sim_nxk[:, 0]  # the global top-1 is the row maximum
  col_max_cos_Km = _gather_max(
      first_max(jnp.where(valid_n[:, None], cos_nxKm, -jnp.inf), 0), token_axes, 0)
  if distance == "cosine":
    row_min_dist_n = 1.0 - row_max_cos_n
    col_min_dist_Km = 1.0 - col_max_cos_Km
  else:
    sqdist_nxKm = s.sqdist()
    row_min_dist_n = _gather_min(first_min(sqdist_nxKm, -1), (MODEL_AXIS,), 1)
    col_min_dist_Km = _gather_min(
        first_min(jnp.where(valid_n[:, None], sqdist_nxKm, jnp.inf), 0), token_axes, 0)
  return (idx_nxk, act_nxk, sim_nxk, z_hat_nxD, row_max_cos_n, col_max_cos_Km,
          row_min_dist_n, col_min_dist_Km)


def topk_reconstruct_sharded(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                             mixture: str = "raw", distance: str = "cosine",
                             mask_N: jax.Array | None = None,
                             implementation: str | None = None):
  """Same contract and outputs as `topk_reconstruct_xla`, on the active mesh.

  Needs a mesh (jax.set_mesh) with a `model` axis dividing K. `implementation` as in
  `prototype_layer`: a Pallas one (or None on TPU/GPU) runs the per-shard similarity,
  top-k and statistics in the fused kernel; "xla" (or None on CPU) in XLA.
  """
  opts = _kernel_opts(implementation, distance)
  mesh = jax.sharding.get_abstract_mesh()
  num_tokens, num_protos = z_NxD.shape[0], protos_KxD.shape[0]
  if mesh.empty or MODEL_AXIS not in mesh.axis_names:
    raise ValueError("topk_reconstruct_sharded needs an active mesh with a 'model' axis "
                     "(use `with jax.set_mesh(mesh):`)")
  if num_protos % mesh.shape[MODEL_AXIS]:
    raise ValueError(f"K={num_protos} is not divisible by the model axis "
                     f"({mesh.shape[MODEL_AXIS]})")
  tok = _token_axes(mesh, num_tokens)
  tok_spec = tok if tok else None
  row, rows2 = P(tok_spec), P(tok_spec, None)
  col = P(MODEL_AXIS)

  def body(z, p, mask):
    if opts is not None:
      return _local_kernel(z, p, mask, k=k, mixture=mixture, distance=distance,
                           token_axes=tok, opts=opts)
    return _local_layer(z, p, mask, k=k, mixture=mixture, distance=distance, token_axes=tok)

  mask = jnp.ones(num_tokens, bool) if mask_N is None else mask_N.astype(bool)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(rows2, P(MODEL_AXIS, None), row),
                     out_specs=(rows2, rows2, rows2, rows2, row, col, row, col),
                     check_vma=opts is None)
  return fn(z_NxD, protos_KxD, mask)
