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

from pallas_kernels.topk_reconstruct import topk_major

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


def similarity_terms(z_NxD: jax.Array, protos_KxD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The squared norms |z_n|^2 and |p_k|^2 both layouts scale by."""
  return jnp.sum(z_NxD * z_NxD, axis=-1), jnp.sum(protos_KxD * protos_KxD, axis=-1)


def similarity(z_NxD: jax.Array, protos_KxD: jax.Array) -> Similarity:
  """Cosine similarities via one matmul; norms guarded by EPS. Keeps the input dtype
  (float64 for the curvature references), so callers cast first where they need to."""
  sqnorm_z_N, sqnorm_p_K = similarity_terms(z_NxD, protos_KxD)
  dot_NxK = jnp.dot(z_NxD, protos_KxD.T, precision=jax.lax.Precision.HIGHEST)
  return Similarity(dot_NxK, sqnorm_z_N, sqnorm_p_K,
                    dot_NxK * inv_norm(sqnorm_z_N)[:, None] * inv_norm(sqnorm_p_K)[None, :])


class SimilarityKxN(NamedTuple):
  """`Similarity` laid out prototypes x tokens (XLA:CPU's fast layout for the top-k and
  the per-prototype statistics, topk_major.py): the same values, transposed."""

  dot_KxN: jax.Array
  sqnorm_z_N: jax.Array
  sqnorm_p_K: jax.Array
  cos_KxN: jax.Array

  def sqdist(self) -> jax.Array:
    return jnp.maximum(self.sqnorm_z_N[None, :] + self.sqnorm_p_K[:, None]
                       - 2.0 * self.dot_KxN, 0.0)


def similarity_KxN(z_NxD: jax.Array, protos_KxD: jax.Array) -> SimilarityKxN:
  """`similarity` transposed: each entry by the same ops in the same order (the dot of
  the same two rows; XLA:CPU's dot gives the same bits in either orientation, tested)."""
  s = similarity_terms(z_NxD, protos_KxD)
  dot_KxN = jnp.dot(protos_KxD, z_NxD.T, precision=jax.lax.Precision.HIGHEST)
  return SimilarityKxN(dot_KxN, s[0], s[1],
                       dot_KxN * inv_norm(s[0])[None, :] * inv_norm(s[1])[:, None])


def _first_extremum(x: jax.Array, axis: int, largest: bool) -> tuple[jax.Array, jax.Array]:
  """(value, int32 index) of the first max (or min) along `axis`: first_max's pick, the
  index jnp.argmax / argmin return (NaN counts as the extremum), by two plain reductions
  (the extremum, then the lowest index holding it): XLA:CPU runs argmax's variadic
  (value, index) reduce ~5x slower, ~10 ms over an N x K = 256 x 8192 matrix."""
  best = jnp.max(x, axis, keepdims=True) if largest else jnp.min(x, axis, keepdims=True)
  hit = (x == best) | jnp.isnan(x)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim)
  arg = jnp.min(jnp.where(jax.lax.stop_gradient(hit), iota, x.shape[axis]), axis, keepdims=True)
  return (jnp.squeeze(jnp.take_along_axis(x, arg, axis=axis), axis),
          jnp.squeeze(arg, axis))


def first_max(x: jax.Array, axis: int) -> jax.Array:
  """max along `axis` whose gradient goes to the first (lowest-index) maximum only.

  jnp.max splits the gradient evenly among exact ties; the Pallas kernels can only name
  one element per row/column without the N x K matrix, so every implementation breaks ties
  of the extremum statistics the same documented way: lowest prototype id (rows), lowest
  token id (columns), as lax.top_k and jnp.argmax do."""
  return _first_extremum(x, axis, largest=True)[0]


def first_min(x: jax.Array, axis: int) -> jax.Array:
  """min along `axis` with the gradient on the first minimum (see first_max)."""
  return -first_max(-x, axis)


def mixture_weights(sim_Nxk: jax.Array, mixture: str) -> jax.Array:
  """Activations a = ReLU(sim) of the active prototypes, normalised to sum 1 if asked."""
  act_Nxk = jax.nn.relu(sim_Nxk)
  if mixture == "normalized":
    act_Nxk = act_Nxk / jnp.maximum(jnp.sum(act_Nxk, axis=-1, keepdims=True), EPS)
  return act_Nxk


def top_k(x_NxK: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """lax.top_k along the last axis (values by decreasing size, ties to the lower index).
  On CPU its outputs pass an optimization barrier: XLA:CPU runs lax.top_k as its TopK
  custom call (one partial selection per row) when the outputs stay unfused, and falls back
  to a full O(K log K) sort of every row when a consumer fusion (the mixture's row
  gathers) would absorb them: at K 8192 the sort costs ~8x the selection."""
  out = jax.lax.top_k(x_NxK, k)
  return jax.lax.optimization_barrier(out) if jax.default_backend() == "cpu" else out


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
  return Mixture(sim_Nxk, idx_Nxk.astype(jnp.int32), act_Nxk,
                 reconstruct(act_Nxk, protos_KxD[idx_Nxk]))


def reconstruct(act_Nxk: jax.Array, rows_NxkxD: jax.Array) -> jax.Array:
  """z_hat = sum_j act_j rows_j, rows = protos[idx] (the reference's one contraction)."""
  return jnp.einsum("nk,nkd->nd", act_Nxk, rows_NxkxD, precision=jax.lax.Precision.HIGHEST)


def wide_dtype(*xs) -> jnp.dtype:
  """The dtype the reference computes in: the inputs' widened to at least float32."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def topk_reconstruct_xla(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                         mixture: str = "raw", distance: str = "cosine",
                         mask_N: jax.Array | None = None):
  """Pure-JAX reference: (idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist,
  col_min_dist) in float32 (float64 for float64 inputs). The oracle of every kernel."""
  dtype = wide_dtype(z_NxD, protos_KxD)
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


def kernel_stats_xla(z_NxD, protos_KxD, valid_N, k: int, distance: str = "cosine"):
  """The kernels' statistics (launch.kernel_stats' tuple: sim_Nxk, idx_Nxk, col_max_cos_K,
  col_arg_cos_K[, row_min_sq_N, row_arg_sq_N, col_min_sq_K, col_arg_sq_K]) from the dense
  similarity, with `topk_reconstruct_xla`'s values (the same ops): the forward of the XLA
  path whose backward is vjp.py's sparse one (implementation "xla_sparse"). On CPU the
  similarity is laid out K x N and the top-k is topk_major's (the same bits and indices;
  the statistics 1.7-1.9x faster at the byte config, experiments/bench_topk.py)."""
  dtype = wide_dtype(z_NxD, protos_KxD)
  z, p = z_NxD.astype(dtype), protos_KxD.astype(dtype)
  if jax.default_backend() == "cpu" and k <= topk_major.MAX_K:
    s, tok = similarity_KxN(z, p), 1  # the token axis of cos and sqdist
    cos = s.cos_KxN
    sim_Nxk, idx_Nxk = topk_major.top_k(cos, k)
  else:
    s, tok = similarity(z, p), 0
    cos = s.cos_NxK
    sim_Nxk, idx_Nxk = top_k(cos, k)
  valid = jnp.expand_dims(valid_N.astype(bool), 1 - tok)
  out = (sim_Nxk, idx_Nxk.astype(jnp.int32))
  out += _first_extremum(jnp.where(valid, cos, -jnp.inf), tok, largest=True)
  if distance == "sqeuclidean":
    sqdist = s.sqdist()
    out += _first_extremum(sqdist, 1 - tok, largest=False)
    out += _first_extremum(jnp.where(valid, sqdist, jnp.inf), tok, largest=False)
  return out


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
