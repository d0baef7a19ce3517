"""Pure-JAX oracle for the fused top-k prototype reconstruction (delegates to the model's
XLA path, which materialises the N x K similarity matrix)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prism_jax.model.prototypes import _EPS, topk_reconstruct_xla


def topk_reconstruct_reference(z_NxD, protos_KxD, k, *, mixture="raw", distance="cosine",
                               mask_N=None):
  """(idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist, col_min_dist), fp32."""
  return topk_reconstruct_xla(z_NxD, protos_KxD, k, mixture=mixture, distance=distance,
                              mask_N=mask_N)


def argstats_reference(z_NxD, protos_KxD, *, distance="cosine", mask_N=None):
  """Arg-extrema the kernels return for the backward: (row argmax cos, col argmax cos
  over valid tokens[, row argmin sqdist, col argmin sqdist]), int32, lowest id on ties."""
  z = z_NxD.astype(jnp.float32)
  p = protos_KxD.astype(jnp.float32)
  sq_z, sq_p = jnp.sum(z * z, -1), jnp.sum(p * p, -1)
  dot = jnp.dot(z, p.T, precision=jax.lax.Precision.HIGHEST)
  cos = (dot * jax.lax.rsqrt(jnp.maximum(sq_z, _EPS * _EPS))[:, None]
         * jax.lax.rsqrt(jnp.maximum(sq_p, _EPS * _EPS))[None, :])
  valid = jnp.ones(z.shape[0], bool) if mask_N is None else mask_N.astype(bool)
  out = [jnp.argmax(cos, 1), jnp.argmax(jnp.where(valid[:, None], cos, -jnp.inf), 0)]
  if distance == "sqeuclidean":
    sq = jnp.maximum(sq_z[:, None] + sq_p[None, :] - 2.0 * dot, 0.0)
    out += [jnp.argmin(sq, 1), jnp.argmin(jnp.where(valid[:, None], sq, jnp.inf), 0)]
  return tuple(o.astype(jnp.int32) for o in out)
