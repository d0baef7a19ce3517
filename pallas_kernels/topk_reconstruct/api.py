"""Fused sparse top-k prototype reconstruction: implementation switch and custom_vjp.

    topk_reconstruct(z_NxD, protos_KxD, k, *, mixture, distance, mask_N, implementation)
      -> (idx_Nxk, act_Nxk, sim_Nxk, z_hat_NxD, row_max_cos_N, col_max_cos_K,
          row_min_dist_N, col_min_dist_K)            same contract as topk_reconstruct_xla

implementation: None (best for the backend: Mosaic on TPU, Triton on GPU, the XLA
reference elsewhere, so CPU training stays fast, and wherever the backend's Pallas lowering
does not import) | "xla" | "pallas_tpu" | "pallas_gpu" |
"pallas_interpret" (the TPU kernel under interpret=True, for CPU tests).

The kernels (tpu.py, gpu.py) return only the per-row top-k (ids + cosines), the per-row
min squared distance with its arg, and per-prototype maxima/minima over valid tokens with
their token id; the N x K matrix never reaches device memory. The k-row reconstruction
z_hat = sum_j act_j p[idx_j] is done by XLA row gathers (`gather_mix`: N*k*D work, k/K of
the kernel's, bandwidth-bound, never an N x k x D buffer). Ties: lower prototype id
first, lower token id first for the per-prototype statistics, exactly like the reference.
Under a mesh the kernel runs per token shard (sharded.py).

Backward (custom_vjp of the kernel's statistics): every differentiable output is a cosine
or squared distance of one (token, prototype) pair named by the forward (the N*k active
pairs, the N row extrema and the K column extrema), so the gradient touches only those
pairs: a gather-reduce into dz and a scatter-add into the bank. Unsharded, the
statistics, the mixture and z_hat form one custom_vjp (`_layer`): the mixture's vjp is
taken inside the backward, and the bank's gradients through z_hat (act[n, j] g_zhat[n])
and through the cosines (c[n, j] z[n]) hit the same rows idx[n, j], so they are summed per
row and scatter-added once (k scatters of N rows instead of 2k; the scatters dominate the
backward's memory traffic). Under a mesh (sharded.py, and
prism_jax.model.sharded_prototypes) the statistics (`_stats`) and `gather_mix` keep
separate sparse custom_vjps, since the statistics run inside shard_map.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels.topk_reconstruct import common, reference, sharded
from prism_jax.model.prototypes import mixture_weights

_EPS = 1e-6  # same guard as prism_jax.model.prototypes
IMPLEMENTATIONS = (None, "xla", "pallas_tpu", "pallas_gpu", "pallas_interpret")
_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class KernelOptions(NamedTuple):
  """Static kernel choices (hashable: a custom_vjp non-differentiable argument)."""
  distance: str = "cosine"
  backend: str = "tpu"  # "tpu" | "gpu"
  interpret: bool = False
  block_n: int | None = None
  block_k: int | None = None
  block_d: int | None = None  # GPU only
  precision: str = "tf32x3"  # GPU fp32 only: "tf32x3" | "ieee" | "tf32"
  num_warps: int | None = None  # GPU only; None: gpu.default_config(dtype)
  num_stages: int | None = None  # GPU only; None: gpu.default_config(dtype)


def resolve_implementation(implementation: str | None) -> str:
  """The implementation that will run: None picks by the default backend, and falls back
  to the XLA reference (with a warning) when that backend's Pallas lowering is missing."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; use one of {IMPLEMENTATIONS}")
  if implementation is not None:
    return implementation
  platform = jax.default_backend()
  kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform)
  if kernel is None or not _kernel_importable(kernel):
    return "xla"
  return kernel


@functools.cache
def _kernel_importable(kernel: str) -> bool:
  """Whether the kernel module (and so its Pallas lowering) imports under this jax."""
  module = "tpu" if kernel == "pallas_tpu" else "gpu"
  try:
    importlib.import_module(f"pallas_kernels.topk_reconstruct.{module}")
    return True
  except ImportError as e:
    warnings.warn(f"{kernel} unavailable under jax {jax.__version__} ({e}); the prototype "
                  "layer uses the XLA reference (implementation='xla')", stacklevel=3)
    return False


def _check_blocks(opts: KernelOptions) -> None:
  """Explicit block sizes the kernels cannot tile with get a clear error, not a lowering
  failure: Triton needs powers of two >= 16 (tensor-core dot), Mosaic TPU needs token
  blocks in multiples of 8 sublanes and prototype blocks in multiples of 128 lanes."""
  given = {name: getattr(opts, name) for name in ("block_n", "block_k", "block_d")
           if getattr(opts, name) is not None}
  for name, size in given.items():
    if opts.backend == "gpu" and (size < 16 or size & (size - 1)):
      raise ValueError(f"{name}={size}: the GPU kernel needs a power of two >= 16")
    if opts.backend == "tpu" and name == "block_d":
      raise ValueError("block_d is a GPU-only option (the TPU kernel takes all of D)")
  if opts.backend == "tpu" and given.get("block_n", 8) % 8:
    raise ValueError(f"block_n={given['block_n']}: the TPU kernel needs a multiple of 8")
  if opts.backend == "tpu" and given.get("block_k", 128) % 128:
    raise ValueError(f"block_k={given['block_k']}: the TPU kernel needs a multiple of 128")


def _blocks(opts: KernelOptions, n: int, k_protos: int, dtype):
  """Block sizes clipped to the problem so tiny inputs are not padded to huge tiles."""
  _check_blocks(opts)  # every kernel entry point resolves its blocks here
  if opts.backend == "gpu":
    from pallas_kernels.topk_reconstruct import gpu  # pylint: disable=import-outside-toplevel
    cfg = gpu.default_config(dtype)
    bn = opts.block_n or min(cfg.block_n, max(16, _next_pow2(n)))
    bk = opts.block_k or min(cfg.block_k, max(16, _next_pow2(k_protos)))
    return bn, bk, opts.block_d or cfg.block_d
  from pallas_kernels.topk_reconstruct import tpu  # pylint: disable=import-outside-toplevel
  bn = opts.block_n or min(tpu.DEFAULT_BLOCK_N, common.round_up(n, 16))  # bf16 packs 16 rows
  bk = opts.block_k or min(tpu.DEFAULT_BLOCK_K, common.round_up(k_protos, 128))
  return bn, bk, None


def _next_pow2(x: int) -> int:
  p = 1
  while p < x:
    p *= 2
  return p


def _pad2(x, rows: int, cols: int, value=0.0):
  pr, pc = rows - x.shape[0], cols - x.shape[1]
  return x if pr == pc == 0 else jnp.pad(x, ((0, pr), (0, pc)), constant_values=value)


def _norms(x_f32):
  sq = jnp.sum(x_f32 * x_f32, axis=-1)
  return sq, jax.lax.rsqrt(jnp.maximum(sq, _EPS * _EPS))


def _mix(w_Nxk, idx_Nxk, p_KxD, sequential: bool):
  """sum_j w_j p[idx_j] in float32. Never an N x k x D operand (6.3 GiB at the XL shape):
  unrolled row gathers that XLA:GPU fuses into one elementwise sum, or (TPU, whose XLA does
  not fuse gathers) a loop over j holding one N x D gather at a time. Rows are gathered in
  p's own dtype and widened after the gather (exact), so bf16 moves half the bytes; the
  same holds for `_scatter_mix` and `_dot_rows`."""
  if sequential:
    body = lambda j, acc: acc + w_Nxk[:, j, None] * p_KxD[idx_Nxk[:, j]]
    return jax.lax.fori_loop(0, idx_Nxk.shape[1], body,
                             jnp.zeros((w_Nxk.shape[0], p_KxD.shape[1]), jnp.float32))
  out = w_Nxk[:, 0, None] * p_KxD[idx_Nxk[:, 0]]
  for j in range(1, idx_Nxk.shape[1]):
    out = out + w_Nxk[:, j, None] * p_KxD[idx_Nxk[:, j]]
  return out


def _scatter_mix(terms, idx_Nxk, num_rows: int, sequential: bool):
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


def _dot_rows(g_NxD, idx_Nxk, p_KxD, sequential: bool):
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


def _kernel_stats(z_NxD, p_KxD, valid_N, k: int, opts: KernelOptions):
  """Runs the kernel; returns (sim_Nxk, idx_Nxk, col_max_cos_K, col_arg_cos_K) plus, for
  sqeuclidean, (row_min_sq_N, row_arg_sq_N, col_min_sq_K, col_arg_sq_K)."""
  n, d = z_NxD.shape
  num_protos = p_KxD.shape[0]
  dtype = z_NxD.dtype if z_NxD.dtype == p_KxD.dtype else jnp.float32
  if dtype not in _KERNEL_DTYPES:
    dtype = jnp.float32
  sq_z, inv_z = _norms(z_NxD.astype(jnp.float32))
  sq_p, inv_p = _norms(p_KxD.astype(jnp.float32))
  bn, bk, bd = _blocks(opts, n, num_protos, dtype)
  n_pad, k_pad = common.round_up(n, bn), common.round_up(num_protos, bk)
  d_pad = d if bd is None else common.round_up(d, bd)
  kp = common.padded_k(k)
  sqeuclid = opts.distance == "sqeuclidean"
  args = (_pad2(z_NxD.astype(dtype), n_pad, d_pad), _pad2(p_KxD.astype(dtype), k_pad, d_pad),
          _pad2(inv_z[:, None], n_pad, 1), _pad2(inv_p[None, :], 1, k_pad),
          _pad2(valid_N.astype(jnp.float32)[:, None], n_pad, 1),
          _pad2(sq_z[:, None], n_pad, 1), _pad2(sq_p[None, :], 1, k_pad))
  kw = dict(num_protos=num_protos, kp=kp, sqeuclid=sqeuclid, block_n=bn, block_k=bk,
            interpret=opts.interpret)
  if opts.backend == "gpu":
    from pallas_kernels.topk_reconstruct import gpu  # pylint: disable=import-outside-toplevel
    cfg = gpu.default_config(dtype)
    outs = gpu.topk_stats_gpu(*args, block_d=bd, precision=opts.precision,
                              num_warps=opts.num_warps or cfg.num_warps,
                              num_stages=opts.num_stages or cfg.num_stages, **kw)
  else:
    from pallas_kernels.topk_reconstruct import tpu  # pylint: disable=import-outside-toplevel
    outs = tpu.topk_stats_tpu(*args, **kw)
  vals, ids, cmax, carg = outs[:4]
  sim, idx = common.finish_topk(vals[:n], ids[:n], k)
  part = lambda x: x.reshape(x.shape[0], -1)[:, :num_protos]
  col_max, col_arg = common.reduce_cols(part(cmax), part(carg), largest=True)
  result = (sim, idx, col_max, col_arg)
  if sqeuclid:
    rmin, rarg, cmin, cminarg = outs[4:]
    col_min, col_min_arg = common.reduce_cols(part(cmin), part(cminarg), largest=False)
    result += (rmin[:n, 0], rarg[:n, 0].astype(jnp.int32), col_min, col_min_arg)
  return result


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _stats(z_NxD, p_KxD, valid_N, k, opts):
  return _kernel_stats(z_NxD, p_KxD, valid_N, k, opts)


def _stats_fwd(z_NxD, p_KxD, valid_N, k, opts):
  out = _kernel_stats(z_NxD, p_KxD, valid_N, k, opts)
  return out, (z_NxD, p_KxD, valid_N, out)


def _stats_bwd(k, opts, res, cts):
  del k
  z_NxD, p_KxD, valid_N, out = res
  dz, dp = _stats_grads(opts, z_NxD, p_KxD, out, cts)
  return dz.astype(z_NxD.dtype), dp.astype(p_KxD.dtype), jnp.zeros_like(valid_N)


_stats.defvjp(_stats_fwd, _stats_bwd)


def _stats_grads(opts, z_NxD, p_KxD, out, cts, pair_terms=()):
  """Cotangents of (sim, ., col_max_cos, . [, row_min_sq, ., col_min_sq, .]) -> float32
  dz, dp. `pair_terms` ((w_Nxk, x_NxD), ...) join the active pairs' scatter-add into the
  bank (row idx[n, j] += w[n, j] x[n]), so a caller's z_hat gradient costs no second set
  of k scatters (see `_layer_bwd`)."""
  z = z_NxD.astype(jnp.float32)
  p = p_KxD.astype(jnp.float32)
  sq_z, inv_z = _norms(z)
  sq_p, inv_p = _norms(p)
  # d rsqrt(max(|x|^2, eps^2)) is zero where the guard is active.
  live_z = jnp.where(sq_z > _EPS * _EPS, 1.0, 0.0)
  live_p = jnp.where(sq_p > _EPS * _EPS, 1.0, 0.0)
  sim, idx, col_max, col_arg = out[:4]
  g_sim, g_cmax = cts[0], cts[2]

  # Cosine pairs: the N*k active pairs, then the K per-prototype maxima.
  # d cos/dz = a b p - cos a^2 z, d cos/dp = a b z - cos b^2 p  (a = 1/|z|, b = 1/|p|).
  seq = opts.backend == "tpu"
  gb_Nxk = g_sim * inv_p[idx]
  dz = inv_z[:, None] * _mix(gb_Nxk, idx, p_KxD, seq)  # gathers in p's dtype
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
  z_c = z[col_arg]
  dz = dz.at[col_arg].add((g_c * a_c * inv_p)[:, None] * p
                          - (g_c * c_c * a_c ** 2 * live_z[col_arg])[:, None] * z_c)
  dp += (g_c * a_c * inv_p)[:, None] * z_c - (g_c * c_c * inv_p ** 2 * live_p)[:, None] * p

  if opts.distance == "sqeuclidean":
    _, row_arg, col_min, col_min_arg = out[4:]
    g_rmin, g_cmin = cts[4], cts[6]
    # d max(|z|^2+|p|^2-2 z.p, 0) = 2(z-p) dz + 2(p-z) dp, halved on the clamp's tie (as
    # jnp.maximum), zero below it.
    def pair_grad(g, n_ids, k_ids):
      zn, pk = z[n_ids], p[k_ids]
      x = sq_z[n_ids] + sq_p[k_ids] - 2.0 * jnp.einsum(
          "md,md->m", zn, pk, precision=jax.lax.Precision.HIGHEST)
      gate = jnp.where(x > 0.0, 1.0, jnp.where(x == 0.0, 0.5, 0.0))
      return (2.0 * g * gate)[:, None] * (zn - pk)
    dz += pair_grad(g_rmin, jnp.arange(z.shape[0]), row_arg)
    dp = dp.at[row_arg].add(-pair_grad(g_rmin, jnp.arange(z.shape[0]), row_arg))
    okc = jnp.isfinite(col_min)
    gq = pair_grad(jnp.where(okc, g_cmin, 0.0), col_min_arg, jnp.arange(p.shape[0]))
    dz = dz.at[col_min_arg].add(gq)
    dp -= gq
  return dz, dp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer(z_NxD, p_KxD, valid_N, k, opts, mixture):
  """Unsharded layer: (kernel statistics, act_Nxk, z_hat_NxD) under one custom_vjp, so the
  bank's gradient through z_hat and through the cosines is one set of k scatter-adds."""
  return _layer_fwd(z_NxD, p_KxD, valid_N, k, opts, mixture)[0]


def _layer_fwd(z_NxD, p_KxD, valid_N, k, opts, mixture):
  out = _kernel_stats(z_NxD, p_KxD, valid_N, k, opts)
  act_Nxk = mixture_weights(out[0], mixture)
  z_hat_NxD = _mix(act_Nxk, out[1], p_KxD, opts.backend == "tpu")  # float32, see _mix
  return (out, act_Nxk, z_hat_NxD), (z_NxD, p_KxD, valid_N, out, act_Nxk)


def _layer_bwd(k, opts, mixture, res, cts):
  """z_hat's backward (`_gather_mix_bwd`) and the mixture's folded into `_stats_grads`: row
  idx[n, j] of dp gets act[n, j] g_zhat[n] + c[n, j] z[n] in one scatter-add."""
  del k
  z_NxD, p_KxD, valid_N, out, act_Nxk = res
  cts_out, g_act_Nxk, g_zhat_NxD = cts
  sim_Nxk, idx_Nxk = out[0], out[1]
  g_act_Nxk = g_act_Nxk + _dot_rows(g_zhat_NxD, idx_Nxk, p_KxD, opts.backend == "tpu")
  _, mixture_vjp = jax.vjp(lambda s: mixture_weights(s, mixture), sim_Nxk)
  g_sim_Nxk = cts_out[0] + mixture_vjp(g_act_Nxk)[0]
  dz, dp = _stats_grads(opts, z_NxD, p_KxD, out, (g_sim_Nxk,) + tuple(cts_out[1:]),
                        ((act_Nxk, g_zhat_NxD),))
  return dz.astype(z_NxD.dtype), dp.astype(p_KxD.dtype), jnp.zeros_like(valid_N)


_layer.defvjp(_layer_fwd, _layer_bwd)


def topk_reconstruct(z_NxD, protos_KxD, k, *, mixture="raw", distance="cosine", mask_N=None,
                     implementation=None, block_n=None, block_k=None, block_d=None,
                     precision="tf32x3", num_warps=None, num_stages=None):
  """See the module docstring. Blocks, GPU fp32 precision, warps and pipeline stages are
  tuning knobs; None takes the backend's defaults (gpu.default_config, tpu.DEFAULT_*)."""
  impl = resolve_implementation(implementation)
  if impl == "xla":
    return reference.topk_reconstruct_reference(z_NxD, protos_KxD, k, mixture=mixture,
                                                distance=distance, mask_N=mask_N)
  if mixture not in ("raw", "normalized") or distance not in ("cosine", "sqeuclidean"):
    raise ValueError(f"mixture={mixture!r} / distance={distance!r} not supported")
  if not isinstance(k, int) or not 1 <= k <= protos_KxD.shape[0]:
    raise ValueError(f"k must be an int in [1, K={protos_KxD.shape[0]}], got {k!r}")
  if protos_KxD.shape[0] >= common.MAX_ID or z_NxD.shape[0] >= common.MAX_ID:
    raise ValueError("N and K must be < 2**24 (ids are exact float32 in the kernel)")
  opts = KernelOptions(distance=distance, backend="gpu" if impl == "pallas_gpu" else "tpu",
                       interpret=impl == "pallas_interpret", block_n=block_n,
                       block_k=block_k, block_d=block_d, precision=precision,
                       num_warps=num_warps, num_stages=num_stages)
  return run_with_options(z_NxD, protos_KxD, k, opts, mixture=mixture, mask_N=mask_N)


def _no_f64(x):
  """float64 (under x64) computed in float32, as the XLA path does: the kernels and the
  float32 accumulators of `_mix` have no float64 variant (gradients flow back as float64)."""
  return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def run_with_options(z_NxD, protos_KxD, k, opts: KernelOptions, *, mixture="raw",
                     mask_N=None):
  """`topk_reconstruct` with explicit kernel options (e.g. the GPU kernel interpreted)."""
  z_NxD, protos_KxD = _no_f64(z_NxD), _no_f64(protos_KxD)
  distance = opts.distance
  n = z_NxD.shape[0]
  valid_N = (jnp.ones((n,), jnp.float32) if mask_N is None
             else mask_N.astype(bool).astype(jnp.float32))
  axes = sharded.token_axes(n)
  if axes:  # an active mesh splits the tokens: one kernel per shard (see sharded.py)
    out = sharded.shard_stats(lambda z, p, v: _stats(z, p, v, k, opts), z_NxD, protos_KxD,
                              valid_N, axes, distance == "sqeuclidean")
    out = out[:3] + ((None, out[3], None, out[4]) if distance == "sqeuclidean" else ())
    act = mixture_weights(out[0], mixture)
    z_hat = gather_mix(act, out[1], protos_KxD, opts.backend == "tpu")  # float32, see _mix
  else:
    out, act, z_hat = _layer(z_NxD, protos_KxD, valid_N, k, opts, mixture)
  sim, idx, col_max_cos = out[0], out[1], out[2]
  row_max_cos = sim[:, 0]
  if distance == "cosine":
    row_min_dist, col_min_dist = 1.0 - row_max_cos, 1.0 - col_max_cos
  else:
    row_min_dist, col_min_dist = out[4], out[6]
  return idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist, col_min_dist


def argstats(z_NxD, protos_KxD, k, opts: KernelOptions, *, mask_N=None):
  """The kernel's arg-extrema (row argmax cos, col argmax cos[, row/col argmin sqdist]),
  for tests against `reference.argstats_reference`."""
  n = z_NxD.shape[0]
  valid_N = jnp.ones((n,), jnp.float32) if mask_N is None else mask_N.astype(jnp.float32)
  out = _kernel_stats(z_NxD, protos_KxD, valid_N, k, opts)
  res = (out[1][:, 0], out[3])
  if opts.distance == "sqeuclidean":
    res += (out[5], out[7])
  return res
