"""The pure maths of the top-k prototype reconstruction (PRISM.md §1) and its XLA oracle.

    s_NxK   = cos(z_NxD, protos_KxD)            one matmul, norms guarded by EPS
    idx_Nxk = top-k of s per row                ties go to the lower prototype id
    act_Nxk = ReLU(s[idx])                      (optionally normalised to sum to 1)
    z_hat   = sum_j act_j protos[idx_j]

Everything here is dtype-generic: it computes in the inputs' dtype widened to at least
float32 (float64 under jax.enable_x64 for the curvature and EK-FAC references). The kernels
(api.py) are tested against `topk_reconstruct_xla`; the model and the attribution code take
`similarity`, `mixture_weights` and `topk_mixture` from here, so each piece exists once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

EPS = 1e-6  # guards the norms of all-zero rows and the sum of all-zero activations


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


def inv_norm(sqnorm: jax.Array) -> jax.Array:
  """1 / max(|x|, EPS) from |x|^2: the guard every implementation uses."""
  return jax.lax.rsqrt(jnp.maximum(sqnorm, EPS * EPS))


def similarity(z_NxD: jax.Array, protos_KxD: jax.Array) -> Similarity:
  """Cosine similarities via one matmul; norms guarded by EPS. Keeps the input dtype
  (float64 for the curvature references), so callers cast first where they need to."""
  sqnorm_z_N = jnp.sum(z_NxD * z_NxD, axis=-1)
  sqnorm_p_K = jnp.sum(protos_KxD * protos_KxD, axis=-1)
  dot_NxK = jnp.dot(z_NxD, protos_KxD.T, precision=jax.lax.Precision.HIGHEST)
  return Similarity(dot_NxK, sqnorm_z_N, sqnorm_p_K,
                    dot_NxK * inv_norm(sqnorm_z_N)[:, None] * inv_norm(sqnorm_p_K)[None, :])


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
    act_Nxk = act_Nxk / jnp.maximum(jnp.sum(act_Nxk, axis=-1, keepdims=True), EPS)
  return act_Nxk


# Largest k that `top_k` selects by k masked argmax passes on CPU (XLA:CPU lowers
# lax.top_k to a full sort of every row: O(K log K) per token against k·K for the passes).
ARGMAX_TOPK_MAX_K = 32


def _total_order_key(x: jax.Array) -> jax.Array:
  """Signed integers ordered as lax.top_k orders floats (total order: -0.0 < +0.0)."""
  int_dtype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, int_dtype)
  return jnp.where(bits < 0, bits ^ jnp.iinfo(int_dtype).max, bits)


def top_k(x_NxK: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """lax.top_k along the last axis (values by decreasing size, ties to the lower index),
  the same values and indices; on CPU for k <= ARGMAX_TOPK_MAX_K as k argmax passes over
  a total-order integer key, each masking the entry it took (the gradient goes to the
  selected entries, as top_k's)."""
  if jax.default_backend() != "cpu" or k > ARGMAX_TOPK_MAX_K or k >= x_NxK.shape[-1]:
    return jax.lax.top_k(x_NxK, k)
  iota = jax.lax.broadcasted_iota(jnp.int32, x_NxK.shape, x_NxK.ndim - 1)
  key = _total_order_key(jax.lax.stop_gradient(x_NxK))
  floor = jnp.iinfo(key.dtype).min  # below every float's key: a taken entry
  picks = []
  for _ in range(k):
    # argmax returns the first maximum: ties go to the lower index, as in lax.top_k.
    idx_N = jnp.argmax(key, axis=-1).astype(jnp.int32)
    picks.append(idx_N)
    key = jnp.where(iota == idx_N[..., None], floor, key)
  idx_Nxk = jnp.stack(picks, axis=-1)
  return jnp.take_along_axis(x_NxK, idx_Nxk, axis=-1), idx_Nxk


class Mixture(NamedTuple):
  sim_Nxk: jax.Array
  idx_Nxk: jax.Array  # int32
  act_Nxk: jax.Array
  z_hat_NxD: jax.Array


def topk_mixture(cos_NxK: jax.Array, protos_KxD: jax.Array, k: int, mixture: str, *,
                 fixed_weights: bool = False) -> Mixture:
  """Top-k of each row of `cos_NxK`, its mixture weights and z_hat = sum_j a_j p[idx_j].
  `fixed_weights` stops the gradient through the weights (P reaches z_hat only through the
  explicit rows: the linear-layer view of PRISM.md §4)."""
  sim_Nxk, idx_Nxk = top_k(cos_NxK, k)
  act_Nxk = mixture_weights(sim_Nxk, mixture)
  if fixed_weights:
    act_Nxk = jax.lax.stop_gradient(act_Nxk)
  z_hat_NxD = jnp.einsum("nk,nkd->nd", act_Nxk, protos_KxD[idx_Nxk],
                         precision=jax.lax.Precision.HIGHEST)
  return Mixture(sim_Nxk, idx_Nxk.astype(jnp.int32), act_Nxk, z_hat_NxD)


def _wide(*xs) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def topk_reconstruct_xla(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                         mixture: str = "raw", distance: str = "cosine",
                         mask_N: jax.Array | None = None):
  """Pure-JAX reference: (idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist,
  col_min_dist) in float32 (float64 for float64 inputs). The oracle of every kernel."""
  dtype = _wide(z_NxD, protos_KxD)
  z, p = z_NxD.astype(dtype), protos_KxD.astype(dtype)
  s = similarity(z, p)
  cos_NxK = s.cos_NxK
  sim_Nxk, idx_Nxk, act_Nxk, z_hat_NxD = topk_mixture(cos_NxK, p, k, mixture)

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
  return (idx_Nxk, act_Nxk, sim_Nxk, z_hat_NxD, row_max_cos_N, col_max_cos_K,
          row_min_dist_N, col_min_dist_K)


topk_reconstruct_reference = topk_reconstruct_xla  # the name the kernel tests use


def argstats_reference(z_NxD, protos_KxD, *, distance="cosine", mask_N=None):
  """Arg-extrema the kernels return for the backward: (row argmax cos, col argmax cos
  over valid tokens[, row argmin sqdist, col argmin sqdist]), int32, lowest id on ties."""
  s = similarity(z_NxD.astype(jnp.float32), protos_KxD.astype(jnp.float32))
  valid = jnp.ones(z_NxD.shape[0], bool) if mask_N is None else mask_N.astype(bool)
  out = [jnp.argmax(s.cos_NxK, 1), jnp.argmax(jnp.where(valid[:, None], s.cos_NxK, -jnp.inf), 0)]
  if distance == "sqeuclidean":
    sq = s.sqdist()
    out += [jnp.argmin(sq, 1), jnp.argmin(jnp.where(valid[:, None], sq, jnp.inf), 0)]
  return tuple(o.astype(jnp.int32) for o in out)
