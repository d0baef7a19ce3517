"""Sparse custom_vjps of the kernel op: every differentiable output is a cosine or squared
distance of one (token, prototype) pair named by the forward (the N*k active pairs, the N
row extrema and the K column extrema), so the gradient touches only those pairs: a
gather-reduce into dz and a scatter-add into the bank.

  gather_mix  z_hat-style mixture sum_j w_j p[idx_j] (k row gathers, never N x k x D)
  stats       the kernel's statistics (launch.kernel_stats); used per shard (sharded.py)
  layer       unsharded: statistics, mixture and z_hat under one custom_vjp. The mixture's
              vjp is taken inside the backward, and the bank's gradients through z_hat
              (act[n, j] g_zhat[n]) and through the cosines (c[n, j] z[n]) hit the same rows
              idx[n, j], so they are summed per row and scatter-added once (k scatters of N
              rows instead of 2k; the scatters dominate the backward's memory traffic).

With `opts.backend == "xla"` the statistics come from the dense N x K similarity
(reference.kernel_stats_xla, the XLA reference's values; cpu.kernel_stats in a program
compiled for CPU) instead of a kernel, and the backward is the same sparse one: O(N k D)
gathers and scatters in place of autodiff's two N x K x D matmuls and its N x K
elementwise chain (implementation "xla_sparse", api.py). Platform choices (the loop form
of the gathers on TPU, CPU barriers) are made when the program is lowered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.topk_reconstruct import cpu, launch, reference
from pallas_kernels.topk_reconstruct.reference import mixture_weights


def _forward_stats(z_NxD, p_KxD, valid_N, k: int, opts):
  """launch.kernel_stats' tuple: from the kernel, or (backend "xla") the dense similarity
  (laid out for XLA:CPU in a program compiled for CPU, cpu.py)."""
  if opts.backend == "xla":
    return cpu.on_cpu(lambda *a: cpu.kernel_stats(*a, k, opts.distance),
                      lambda *a: reference.kernel_stats_xla(*a, k, opts.distance),
                      z_NxD, p_KxD, valid_N)
  return launch.kernel_stats(z_NxD, p_KxD, valid_N, k, opts)


def sequential(opts) -> bool | None:
  """Row gathers one at a time in a loop: TPU's XLA does not fuse gathers (see
  reference.sparse_mixture).
  None (the XLA path): chosen for the platform being compiled (`_per_platform`)."""
  return {"tpu": True, "gpu": False}.get(opts.backend)


def _per_platform(fn, sequential: bool | None, *args):
  """fn(sequential, *args), with sequential=None resolved when the program is lowered:
  the loop on TPU, unrolled elsewhere."""
  if sequential is not None:
    return fn(sequential, *args)
  return jax.lax.platform_dependent(*args, tpu=lambda *a: fn(True, *a),
                                    default=lambda *a: fn(False, *a))


def _mix(w_Nxk, idx_Nxk, p_KxD, sequential: bool | None):
  return _per_platform(_mix_rows, sequential, w_Nxk, idx_Nxk, p_KxD)


def _mix_rows(sequential: bool, w_Nxk, idx_Nxk, p_KxD):
  """reference.sparse_mixture without an N x k x D operand: the loop form on TPU, the
  unrolled row gathers elsewhere (p gathered in its own dtype; the same holds for
  `_scatter_mix` and `_dot_rows`)."""
  return reference.sparse_mixture(w_Nxk, idx_Nxk, p_KxD, gather="loop" if sequential else "rows")


def _scatter_mix(terms, idx_Nxk, num_rows: int, sequential: bool | None):
  return _per_platform(lambda seq, terms, idx: _scatter_rows(terms, idx, num_rows, seq),
                       sequential, terms, idx_Nxk)


def _scatter_rows(terms, idx_Nxk, num_rows: int, sequential: bool):
  """out[i] = sum over (n, j) with idx[n, j] = i of sum_t w_t[n, j] x_t[n], for
  terms = ((w_Nxk, x_NxD), ...): k scatter-adds of N rows, whatever the number of terms
  (the terms are summed per row before the scatter, so the bank is updated k times)."""
  def rows(j):
    out = terms[0][0][:, j, None] * terms[0][1]
    for w_Nxk, x_NxD in terms[1:]:
      out = out + w_Nxk[:, j, None] * x_NxD
    return out
  out = jnp.zeros((num_rows, terms[0][1].shape[1]), jnp.float32)
  step = lambda j, acc: acc.at[idx_Nxk[:, j]].add(rows(j))
  if sequential:
    return jax.lax.fori_loop(0, idx_Nxk.shape[1], step, out)
  for j in range(idx_Nxk.shape[1]):
    out = step(j, out)
  return out


def _dot_rows(g_NxD, idx_Nxk, p_KxD, sequential: bool | None):
  return _per_platform(_dot_rows_of, sequential, g_NxD, idx_Nxk, p_KxD)


def _dot_rows_of(sequential: bool, g_NxD, idx_Nxk, p_KxD):
  """<g_n, p[idx[n, j]]> for every active pair, (N, k)."""
  one = lambda j: jnp.sum(g_NxD * p_KxD[idx_Nxk[:, j]], axis=-1)
  if sequential:
    body = lambda j, acc: acc.at[:, j].set(one(j))
    return jax.lax.fori_loop(0, idx_Nxk.shape[1], body, jnp.zeros(idx_Nxk.shape, jnp.float32))
  return jnp.stack([one(j) for j in range(idx_Nxk.shape[1])], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_mix(w_Nxk, idx_Nxk, p_KxD, sequential: bool):
  """z_hat-style sparse mixture sum_j w_j p[idx_j] with a backward over the N*k pairs."""
  return _mix(w_Nxk, idx_Nxk, p_KxD, sequential)


def _gather_mix_fwd(w_Nxk, idx_Nxk, p_KxD, sequential):
  return _mix(w_Nxk, idx_Nxk, p_KxD, sequential), (w_Nxk, idx_Nxk, p_KxD)


def _gather_mix_bwd(sequential, res, g_NxD):
  w_Nxk, idx_Nxk, p_KxD = res
  dw = _dot_rows(g_NxD, idx_Nxk, p_KxD, sequential)
  dp = _scatter_mix(((w_Nxk, g_NxD),), idx_Nxk, p_KxD.shape[0], sequential)
  return dw.astype(w_Nxk.dtype), None, dp.astype(p_KxD.dtype)


gather_mix.defvjp(_gather_mix_fwd, _gather_mix_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def stats(z_NxD, p_KxD, valid_N, k, opts):
  return _forward_stats(z_NxD, p_KxD, valid_N, k, opts)


def _stats_fwd(z_NxD, p_KxD, valid_N, k, opts):
  out = _forward_stats(z_NxD, p_KxD, valid_N, k, opts)
  return out, (z_NxD, p_KxD, valid_N, out)


def _stats_bwd(k, opts, res, cts):
  del k
  z_NxD, p_KxD, valid_N, out = res
  dz, dp = _stats_grads(opts, z_NxD, p_KxD, out, cts)
  return dz.astype(z_NxD.dtype), dp.astype(p_KxD.dtype), jnp.zeros_like(valid_N)


stats.defvjp(_stats_fwd, _stats_bwd)


def _stats_grads(opts, z_NxD, p_KxD, out, cts, pair_terms=(), rows_NxkxD=None):
  """Cotangents of (sim, ., col_max_cos, . [, row_min_sq, ., col_min_sq, .]) -> float32
  dz, dp. `pair_terms` ((w_Nxk, x_NxD), ...) join the active pairs' scatter-add into the
  bank (row idx[n, j] += w[n, j] x[n]), so a caller's z_hat gradient costs no second set
  of k scatters (see `_layer_bwd`). `rows_NxkxD` (p[idx], the XLA path's) replaces the
  k row gathers of dz."""
  z = z_NxD.astype(jnp.float32)
  p = p_KxD.astype(jnp.float32)
  sq_z, inv_z = launch.norms(z)
  sq_p, inv_p = launch.norms(p)
  # d rsqrt(max(|x|^2, eps^2)) is zero where the guard is active.
  live_z = jnp.where(sq_z > reference.EPS * reference.EPS, 1.0, 0.0)
  live_p = jnp.where(sq_p > reference.EPS * reference.EPS, 1.0, 0.0)
  sim, idx, col_max, col_arg = out[:4]
  g_sim, g_cmax = cts[0], cts[2]

  # Cosine pairs: the N*k active pairs, then the K per-prototype maxima.
  # d cos/dz = a b p - cos a^2 z, d cos/dp = a b z - cos b^2 p  (a = 1/|z|, b = 1/|p|).
  seq = sequential(opts)
  gb_Nxk = g_sim * inv_p[idx]
  if rows_NxkxD is None:
    dz = inv_z[:, None] * _mix(gb_Nxk, idx, p_KxD, seq)  # gathers in p's dtype
  else:
    dz = inv_z[:, None] * reference.reconstruct(gb_Nxk, rows_NxkxD)  # a dot (see _layer_bwd)
  dz -= (inv_z ** 2 * live_z * jnp.sum(g_sim * sim, -1))[:, None] * z
  flat_idx = idx.reshape(-1)
  dp = _scatter_mix(((gb_Nxk * inv_z[:, None], z_NxD),) + tuple(pair_terms), idx,
                    p.shape[0], seq)
  gcos_p = jnp.zeros_like(inv_p).at[flat_idx].add((g_sim * sim).reshape(-1))
  dp -= (inv_p ** 2 * live_p * gcos_p)[:, None] * p

  ok = jnp.isfinite(col_max)
  g_c = jnp.where(ok, g_cmax, 0.0)
  c_c = jnp.where(ok, col_max, 0.0)
  a_c = inv_z[col_arg]
  gab_K = g_c * a_c * inv_p
  col_dz, col_dp = _column_pairs(z, p, col_arg, gab_K, -g_c * c_c * a_c ** 2 * live_z[col_arg],
                                 gab_K, -g_c * c_c * inv_p ** 2 * live_p)
  dz += col_dz
  dp += col_dp

  if opts.distance == "sqeuclidean":
    _, row_arg, col_min, col_min_arg = out[4:]
    g_rmin, g_cmin = cts[4], cts[6]
    # d max(|z|^2+|p|^2-2 z.p, 0) = 2(z-p) dz + 2(p-z) dp, halved on the clamp's tie (as
    # jnp.maximum), zero below it.
    def pair_coef(g, zn, pk, n_ids, k_ids):
      x = sq_z[n_ids] + sq_p[k_ids] - 2.0 * jnp.einsum(
          "md,md->m", zn, pk, precision=jax.lax.Precision.HIGHEST)
      return 2.0 * g * jnp.where(x > 0.0, 1.0, jnp.where(x == 0.0, 0.5, 0.0))
    p_row = p[row_arg]
    g_row = pair_coef(g_rmin, z, p_row, slice(None), row_arg)[:, None] * (z - p_row)
    dz += g_row
    dp = dp.at[row_arg].add(-g_row)
    z_col = z[col_min_arg]
    c_K = pair_coef(jnp.where(jnp.isfinite(col_min), g_cmin, 0.0), z_col, p, col_min_arg,
                    slice(None))
    col_dz, col_dp = _column_pairs(z, p, col_min_arg, -c_K, c_K, -c_K, c_K, z_col)
    dz += col_dz
    dp += col_dp
  return dz, dp


def _column_pairs(z_NxD, p_KxD, arg_K, alpha_K, beta_K, gamma_K, delta_K, z_arg_KxD=None):
  """Gradient terms of the K (token arg[i], prototype i) pairs of a column statistic:
  dz[arg[i]] += alpha_i p_i + beta_i z[arg[i]],  dp_i += gamma_i z[arg[i]] + delta_i p_i.
  The z side is one K-row scatter of alpha p, its operand materialised first on CPU
  (XLA:CPU runs a scatter whose update is a fused expression ~5x slower: 15 ms at
  K 8192, D 768), plus a scalar scatter of beta that scales z once per token."""
  scaled_KxD = cpu.barrier(alpha_K[:, None] * p_KxD)
  beta_N = jnp.zeros(z_NxD.shape[0], z_NxD.dtype).at[arg_K].add(beta_K)
  dz = jnp.zeros_like(z_NxD).at[arg_K].add(scaled_KxD) + beta_N[:, None] * z_NxD
  z_arg_KxD = z_NxD[arg_K] if z_arg_KxD is None else z_arg_KxD
  return dz, gamma_K[:, None] * z_arg_KxD + delta_K[:, None] * p_KxD


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer(z_NxD, p_KxD, valid_N, k, opts, mixture):
  """Unsharded layer: (kernel statistics, act_Nxk, z_hat_NxD) under one custom_vjp, so the
  bank's gradient through z_hat and through the cosines is one set of k scatter-adds."""
  return _layer_fwd(z_NxD, p_KxD, valid_N, k, opts, mixture)[0]


def _layer_fwd(z_NxD, p_KxD, valid_N, k, opts, mixture):
  out = _forward_stats(z_NxD, p_KxD, valid_N, k, opts)
  act_Nxk = mixture_weights(out[0], mixture)
  rows_NxkxD = None
  if opts.backend == "xla":
    # The reference's contraction (its z_hat to the bit); without a kernel the N x k x D
    # rows exist anyway, so the backward reuses them instead of gathering them twice more.
    rows_NxkxD = p_KxD.astype(act_Nxk.dtype)[out[1]]
    z_hat_NxD = reference.reconstruct(act_Nxk, rows_NxkxD)
  else:
    z_hat_NxD = _mix(act_Nxk, out[1], p_KxD, sequential(opts))  # float32, see _mix
  return (out, act_Nxk, z_hat_NxD), (z_NxD, p_KxD, valid_N, out, act_Nxk, rows_NxkxD)


def _layer_bwd(k, opts, mixture, res, cts):
  """z_hat's backward (`_gather_mix_bwd`) and the mixture's folded into `_stats_grads`: row
  idx[n, j] of dp gets act[n, j] g_zhat[n] + c[n, j] z[n] in one scatter-add."""
  del k
  z_NxD, p_KxD, valid_N, out, act_Nxk, rows_NxkxD = res
  cts_out, g_act_Nxk, g_zhat_NxD = cts
  sim_Nxk, idx_Nxk = out[0], out[1]
  if rows_NxkxD is None:
    g_act_Nxk = g_act_Nxk + _dot_rows(g_zhat_NxD, idx_Nxk, p_KxD, sequential(opts))
  else:
    # As dots: XLA:CPU fused the broadcast-multiply-reduce forms of this and of dz with
    # their neighbours into YNNPACK reductions of 0.4 and 0.7 ms (byte config, one core).
    g_act_Nxk = g_act_Nxk + jnp.einsum("nd,nkd->nk", g_zhat_NxD, rows_NxkxD,
                                       precision=jax.lax.Precision.HIGHEST)
  _, mixture_vjp = jax.vjp(lambda s: mixture_weights(s, mixture), sim_Nxk)
  g_sim_Nxk = cts_out[0] + mixture_vjp(g_act_Nxk)[0]
  dz, dp = _stats_grads(opts, z_NxD, p_KxD, out, (g_sim_Nxk,) + tuple(cts_out[1:]),
                        ((act_Nxk, g_zhat_NxD),), rows_NxkxD)
  return dz.astype(z_NxD.dtype), dp.astype(p_KxD.dtype), jnp.zeros_like(valid_N)


layer.defvjp(_layer_fwd, _layer_bwd)
