"""The pure maths of the top-k prototype reconstruction (PRISM.md §1) and its XLA oracle.

    s_NxK   = cos(z_NxD, protos_KxD)            one matmul, norms guarded by EPS
    idx_Nxk = top-k of s per row                ties go to the lower prototype id
    act_Nxk = ReLU(s[idx])                      (optionally normalised to sum to 1)
    z_hat   = sum_j act_j protos[idx_j]

Everything here is dtype-generic: it computes in the inputs' dtype widened to at least
float32 (float64 under jax.enable_x64 for the curvature and EK-FAC references), and plain:
no platform-specific scheduling (the CPU speed path is cpu.py). Every implementation
(api.py) is tested against `topk_reconstruct_xla`; the model, attribution and control take
`similarity`, `mixture_weights`, `topk_mixture` and `sparse_mixture` from here, so each
piece exists once.
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


SCOPE = "cpu_speed_path"  # the name scope of every CPU-only op (tests find them by it)


def on_cpu(cpu_fn, default_fn, *args):
  """`cpu_fn(*args)` in a program compiled for CPU, `default_fn(*args)` elsewhere: chosen
  when the program is lowered (only the chosen branch is lowered), not while tracing."""
  def cpu_scoped(*a):
    with jax.named_scope(SCOPE):
      return cpu_fn(*a)
  return jax.lax.platform_dependent(*args, cpu=cpu_scoped, default=default_fn)


def barrier(x):
  """optimization_barrier on CPU (a value no-op that keeps x unfused), x elsewhere."""
  return on_cpu(jax.lax.optimization_barrier, lambda y: y, x)


def top_k(x_NxK: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """lax.top_k along the last axis, kept unfused on CPU: absorbed by a consumer (the
  mixture's row gathers, a slice of its first column) XLA:CPU falls back to a full
  O(K log K) sort of every row (2.0 s against 0.12 s at the demo's 2048 x 16384)."""
  return barrier(jax.lax.top_k(x_NxK, k))


def first_extremum(x: jax.Array, axis: int, largest: bool) -> tuple[jax.Array, jax.Array]:
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
  return first_extremum(x, axis, largest=True)[0]


def first_min(x: jax.Array, axis: int) -> jax.Array:
  """min along `axis` with the gradient on the first minimum (see first_max)."""
  return -first_max(-x, axis)


def mixture_weights(sim_Nxk: jax.Array, mixture: str) -> jax.Array:
  """Activations a = ReLU(sim) of the active prototypes, normalised to sum 1 if asked."""
  act_Nxk = jax.nn.relu(sim_Nxk)
  if mixture == "normalized":
    act_Nxk = act_Nxk / jnp.maximum(jnp.sum(act_Nxk, axis=-1, keepdims=True), EPS)
  return act_Nxk


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
  sim_Nxk, idx_Nxk = top_k(cos_NxK, k)  # ties to the lower prototype id
  idx_Nxk = idx_Nxk.astype(jnp.int32)
  act_Nxk = mixture_weights(sim_Nxk, mixture)
  if fixed_weights:
    act_Nxk = jax.lax.stop_gradient(act_Nxk)
  return Mixture(sim_Nxk, idx_Nxk, act_Nxk, sparse_mixture(act_Nxk, idx_Nxk, protos_KxD))


def sparse_mixture(w_Nxk: jax.Array, idx_Nxk: jax.Array, rows_KxD: jax.Array, *,
                   gather: str = "all") -> jax.Array:
  """sum_j w_j rows[idx_j], (N, D): the one sparse reconstruction (z_hat, a refill's
  z_hat', a sparse code's direction in the logit edits, the kernel path's z_hat and dz).

  `gather` says how, not what:
    "all"   the N x k x D rows gathered, then one contraction (`reconstruct`): the oracle;
    "rows"  k row gathers summed, never an N x k x D operand (6.3 GiB at the XL shape);
            XLA:GPU fuses them into one elementwise sum;
    "loop"  a loop over j holding one N x D gather at a time (TPU's XLA does not fuse
            gathers).
  "rows" and "loop" gather in rows' own dtype and widen after the gather (exact), so bf16
  moves half the bytes, and sum in the weights' dtype (float32 in the kernel path)."""
  if gather == "all":
    return reconstruct(w_Nxk, rows_KxD[idx_Nxk])
  term = lambda j: w_Nxk[:, j, None] * rows_KxD[idx_Nxk[:, j]]
  if gather == "loop":
    zero = jnp.zeros((w_Nxk.shape[0], rows_KxD.shape[1]),
                     jnp.promote_types(w_Nxk.dtype, rows_KxD.dtype))
    return jax.lax.fori_loop(0, idx_Nxk.shape[1], lambda j, acc: acc + term(j), zero)
  if gather != "rows":
    raise ValueError(f"gather={gather!r}: expected 'all', 'rows' or 'loop'")
  out = term(0)
  for j in range(1, idx_Nxk.shape[1]):
    out = out + term(j)
  return out


def reconstruct(w_Nxk: jax.Array, rows_NxkxD: jax.Array) -> jax.Array:
  """sum_j w_j rows_j over already gathered rows (`sparse_mixture`'s contraction)."""
  return jnp.einsum("nk,nkd->nd", w_Nxk, rows_NxkxD, precision=jax.lax.Precision.HIGHEST)


def wide_dtype(*xs) -> jnp.dtype:
  """The dtype the reference computes in: the inputs' widened to at least float32."""
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


class TopKReconstruction(NamedTuple):
  """The op's outputs for N tokens, K prototypes, k active (every implementation's)."""

  idx_Nxk: jax.Array  # int32 active prototype ids, by decreasing similarity
  act_Nxk: jax.Array  # mixture weights (non-negative)
  sim_Nxk: jax.Array  # cosine similarity of each active prototype
  z_hat_NxD: jax.Array  # sum_j act_j p[idx_j]
  row_max_cos_N: jax.Array  # max_i cos(z_t, p_i)
  col_max_cos_K: jax.Array  # max over valid tokens of cos(p_i, z_t); -inf if none valid
  row_min_dist_N: jax.Array  # min_i dist(z_t, p_i) for the distance
  col_min_dist_K: jax.Array  # min over valid tokens of dist(p_i, z_t); +inf if none valid


def topk_reconstruct_xla(z_NxD: jax.Array, protos_KxD: jax.Array, k: int, *,
                         mixture: str = "raw", distance: str = "cosine",
                         mask_N: jax.Array | None = None) -> TopKReconstruction:
  """Pure-JAX reference in float32 (float64 for float64 inputs): the oracle of every
  implementation, and autodiff end to end (forward mode too, as jax.hessian needs)."""
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
  return TopKReconstruction(idx_Nxk, act_Nxk, sim_Nxk, z_hat_NxD, row_max_cos_N,
                            col_max_cos_K, row_min_dist_N, col_min_dist_K)


topk_reconstruct_reference = topk_reconstruct_xla  # the name the kernel tests use


def kernel_stats_xla(z_NxD, protos_KxD, valid_N, k: int, distance: str = "cosine"):
  """The kernels' statistics (launch.kernel_stats' tuple: sim_Nxk, idx_Nxk, col_max_cos_K,
  col_arg_cos_K[, row_min_sq_N, row_arg_sq_N, col_min_sq_K, col_arg_sq_K]) from the dense
  similarity, with `topk_reconstruct_xla`'s values (the same ops): the forward of the XLA
  path whose backward is vjp.py's sparse one (implementation "xla_sparse"; on CPU it runs
  as cpu.kernel_stats)."""
  dtype = wide_dtype(z_NxD, protos_KxD)
  s = similarity(z_NxD.astype(dtype), protos_KxD.astype(dtype))
  sim_Nxk, idx_Nxk = top_k(s.cos_NxK, k)
  return stats_from_similarity(s, s.cos_NxK, 0, sim_Nxk, idx_Nxk, valid_N, distance)


def stats_from_similarity(s, cos, tok: int, sim_Nxk, idx_Nxk, valid_N, distance: str):
  """kernel_stats_xla's tuple from a similarity whose token axis is `tok` (0: N x K,
  1: K x N, cpu.py's layout) and its top-k."""
  valid = jnp.expand_dims(valid_N.astype(bool), 1 - tok)
  out = (sim_Nxk, idx_Nxk.astype(jnp.int32))
  out += first_extremum(jnp.where(valid, cos, -jnp.inf), tok, largest=True)
  if distance == "sqeuclidean":
    sqdist = s.sqdist()
    out += first_extremum(sqdist, 1 - tok, largest=False)
    out += first_extremum(jnp.where(valid, sqdist, jnp.inf), tok, largest=False)
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
