"""The PRISM prototype layer as a pure function on arrays, plus a thin NNX wrapper.

    s_NxK   = cos(z_NxD, protos_KxD)            computed once
    idx_Nxk = top-k of s per row                ties go to the lower prototype id
    act_Nxk = ReLU(s[idx])                      (optionally normalised to sum to 1)
    z_hat   = sum_j act_j protos[idx_j]
    r       = z - stop_gradient(z_hat)          (straight-through, default) | z - z_hat

The per-row / per-column similarity extrema that R1, R2 and the grounding metrics need
are returned so the N x K matrix is never recomputed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from prism_jax.model.params import normal_param

_EPS = 1e-6  # guards the norms of all-zero rows and the sum of all-zero activations
IMPLEMENTATIONS = (None, "xla", "pallas_tpu", "pallas_gpu", "pallas_interpret")


class PrototypeOutput(NamedTuple):
  """Result of `prototype_layer` for N tokens, K prototypes, k active."""

  idx_Nxk: jax.Array  # int32 active prototype ids, by decreasing similarity
  act_Nxk: jax.Array  # mixture weights used in z_hat (non-negative)
  sim_Nxk: jax.Array  # cosine similarity of each active prototype
  z_hat_NxD: jax.Array  # reconstruction
  residual_NxD: jax.Array  # z - z_hat (gradient routing per option)
  row_max_cos_N: jax.Array  # max_i cos(z_t, p_i)
  col_max_cos_K: jax.Array  # max over valid tokens of cos(p_i, z_t); -inf if none valid
  row_min_dist_N: jax.Array  # min_i dist(z_t, p_i) for the configured distance
  col_min_dist_K: jax.Array  # min over valid tokens of dist(p_i, z_t); +inf if none valid


def validate_inputs(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                    residual_routing: str, mixture: str, distance: str,
                    implementation: str | None, mask_N: jax.Array | None) -> None:
  if z_NxD.ndim != 2 or protos_KxD.ndim != 2:
    raise ValueError(f"prototype_layer expects z of shape (N, D) and protos of shape (K, D); "
                     f"got {z_NxD.shape} and {protos_KxD.shape}")
  if z_NxD.shape[1] != protos_KxD.shape[1]:
    raise ValueError(f"feature sizes differ: z has D={z_NxD.shape[1]}, "
                     f"protos has D={protos_KxD.shape[1]}")
  for name, x in (("z", z_NxD), ("protos", protos_KxD)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
  num_protos = protos_KxD.shape[0]
  if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_protos:
    raise ValueError(f"k must be an int in [1, K={num_protos}], got {k!r}")
  if residual_routing not in ("straight_through", "plain"):
    raise ValueError(f"residual_routing={residual_routing!r}; use 'straight_through' or 'plain'")
  if mixture not in ("raw", "normalized"):
    raise ValueError(f"mixture={mixture!r}; use 'raw' or 'normalized'")
  if distance not in ("cosine", "sqeuclidean"):
    raise ValueError(f"distance={distance!r}; use 'cosine' or 'sqeuclidean'")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; use one of {IMPLEMENTATIONS}")
  if mask_N is not None and mask_N.shape != (z_NxD.shape[0],):
    raise ValueError(f"mask must have shape (N,)=({z_NxD.shape[0]},), got {mask_N.shape}")


class Similarity(NamedTuple):
  """The one N x K matmul of the layer and what is derived from it, in the inputs' dtype."""

  dot_NxK: jax.Array
  sqnorm_z_N: jax.Array
  sqnorm_p_K: jax.Array
  cos_NxK: jax.Array

  def sqdist(self) -> jax.Array:
    """Squared Euclidean distances from the same dot products (clamped at 0)."""
    return jnp.maximum(self.sqnorm_z_N[:, None] + self.sqnorm_p_K[None, :]
                       - 2.0 * self.dot_NxK, 0.0)


def similarity(z_NxD: jax.Array, protos_KxD: jax.Array) -> Similarity:
  """Cosine similarities via one matmul; norms guarded by _EPS. Keeps the input dtype
  (float64 for the curvature references), so callers cast first where they need to."""
  sqnorm_z_N = jnp.sum(z_NxD * z_NxD, axis=-1)
  sqnorm_p_K = jnp.sum(protos_KxD * protos_KxD, axis=-1)
  inv_z_N = jax.lax.rsqrt(jnp.maximum(sqnorm_z_N, _EPS * _EPS))
  inv_p_K = jax.lax.rsqrt(jnp.maximum(sqnorm_p_K, _EPS * _EPS))
  dot_NxK = jnp.dot(z_NxD, protos_KxD.T, precision=jax.lax.Precision.HIGHEST)
  return Similarity(dot_NxK, sqnorm_z_N, sqnorm_p_K,
                    dot_NxK * inv_z_N[:, None] * inv_p_K[None, :])


def first_max(x: jax.Array, axis: int) -> jax.Array:
  """max along `axis` whose gradient goes to the first (lowest-index) maximum only.

  jnp.max splits the gradient evenly among exact ties; the Pallas kernels can only name
  one element per row/column without the N x K matrix, so every implementation breaks ties
  of the extremum statistics the same documented way: lowest prototype id (rows), lowest
  token id (columns), as lax.top_k and jnp.argmax do."""
  arg = jnp.argmax(x, axis=axis, keepdims=True)
  return jnp.squeeze(jnp.take_along_axis(x, arg, axis=axis), axis)


def first_min(x: jax.Array, axis: int) -> jax.Array:
  """min along `axis` with the gradient on the first minimum (see first_max)."""
  return -first_max(-x, axis)


def mixture_weights(sim_Nxk: jax.Array, mixture: str) -> jax.Array:
  """Activations a = ReLU(sim) of the active prototypes, normalised to sum 1 if asked."""
  act_Nxk = jax.nn.relu(sim_Nxk)
  if mixture == "normalized":
    act_Nxk = act_Nxk / jnp.maximum(jnp.sum(act_Nxk, axis=-1, keepdims=True), _EPS)
  return act_Nxk


def topk_reconstruct_xla(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                         mixture: str = "raw", distance: str = "cosine",
                         mask_N: jax.Array | None = None):
  """Pure-JAX reference: (idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist,
  col_min_dist), all in float32. This is the oracle every kernel is tested against."""
  z = z_NxD.astype(jnp.float32)
  p = protos_KxD.astype(jnp.float32)
  s = similarity(z, p)
  cos_NxK = s.cos_NxK

  sim_Nxk, idx_Nxk = jax.lax.top_k(cos_NxK, k)
  act_Nxk = mixture_weights(sim_Nxk, mixture)
  z_hat_NxD = jnp.einsum("nk,nkd->nd", act_Nxk, p[idx_Nxk],
                         precision=jax.lax.Precision.HIGHEST)

  valid_N = jnp.ones(z.shape[0], bool) if mask_N is None else mask_N.astype(bool)
  # Extremum statistics: on exact ties the gradient goes to the lowest id (first_max).
  row_max_cos_N = sim_Nxk[:, 0]  # top_k's first entry: the row maximum, lowest id on ties
  col_max_cos_K = first_max(jnp.where(valid_N[:, None], cos_NxK, -jnp.inf), 0)
  if distance == "cosine":
    row_min_dist_N = 1.0 - row_max_cos_N
    col_min_dist_K = 1.0 - col_max_cos_K
  else:
    sqdist_NxK = s.sqdist()
    row_min_dist_N = first_min(sqdist_NxK, -1)
    col_min_dist_K = first_min(jnp.where(valid_N[:, None], sqdist_NxK, jnp.inf), 0)
  return (idx_Nxk.astype(jnp.int32), act_Nxk, sim_Nxk, z_hat_NxD, row_max_cos_N,
          col_max_cos_K, row_min_dist_N, col_min_dist_K)


def _dispatch(implementation: str | None):
  if implementation in (None, "xla"):
    if implementation is None:
      try:  # Pallas kernels register themselves behind the same switch when present.
        from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
        return api.topk_reconstruct
      except ImportError:
        return topk_reconstruct_xla
    return topk_reconstruct_xla
  from pallas_kernels.topk_reconstruct import api  # pylint: disable=import-outside-toplevel
  return api.topk_reconstruct


def prototype_layer(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                    residual_routing: str = "straight_through", mixture: str = "raw",
                    distance: str = "cosine", implementation: str | None = None,
                    mask_N: jax.Array | None = None) -> PrototypeOutput:
  """Sparse non-negative prototype mixture of PRISM.md §1 (see module docstring).

  `mask_N` marks valid tokens (padding/EOS excluded): only they enter the per-prototype
  (column) statistics used by R1. Outputs are float32 whatever the input dtype.
  """
  validate_inputs(z_NxD, protos_KxD, k, residual_routing=residual_routing, mixture=mixture,
                  distance=distance, implementation=implementation, mask_N=mask_N)
  fn = _dispatch(implementation)
  from prism_jax.model import sharded_prototypes  # pylint: disable=import-outside-toplevel
  if sharded_prototypes.use_sharded(protos_KxD.shape[0]):  # mesh with model axis > 1
    fn = sharded_prototypes.topk_reconstruct_sharded
  kwargs = dict(mixture=mixture, distance=distance, mask_N=mask_N)
  if fn is not topk_reconstruct_xla:
    kwargs["implementation"] = implementation
  (idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist,
   col_min_dist) = fn(z_NxD, protos_KxD, k, **kwargs)
  z = z_NxD.astype(jnp.float32)
  if residual_routing == "straight_through":
    residual = z - jax.lax.stop_gradient(z_hat)
  else:
    residual = z - z_hat
  return PrototypeOutput(idx, act, sim, z_hat, residual, row_max_cos, col_max_cos,
                         row_min_dist, col_min_dist)


class PrototypeBank(nnx.Module):
  """Holds the bank P (K x D, logical axes ("proto", "embed")) and applies the layer."""

  def __init__(self, num_prototypes: int, d_model: int, k: int, *, rngs: nnx.Rngs,
               residual_routing: str = "straight_through", mixture: str = "raw",
               distance: str = "cosine", implementation: str | None = None):
    if not 1 <= k <= num_prototypes:
      raise ValueError(f"k must be in [1, K={num_prototypes}], got {k}")
    self.k = k
    self.residual_routing = residual_routing
    self.mixture = mixture
    self.distance = distance
    self.implementation = implementation
    self.protos = normal_param(rngs, (num_prototypes, d_model), 1.0, ("proto", "embed"))

  def __call__(self, z_NxD: jax.Array, mask_N: jax.Array | None = None) -> PrototypeOutput:
    return prototype_layer(z_NxD, self.protos[...], self.k,
                           residual_routing=self.residual_routing, mixture=self.mixture,
                           distance=self.distance, implementation=self.implementation,
                           mask_N=mask_N)
