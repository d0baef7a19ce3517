"""Fused sparse top-k prototype reconstruction: the implementation switch and its options.

    topk_reconstruct(z_NxD, protos_KxD, k, *, mixture, distance, mask_N, implementation)
      -> (idx_Nxk, act_Nxk, sim_Nxk, z_hat_NxD, row_max_cos_N, col_max_cos_K,
          row_min_dist_N, col_min_dist_K)            same contract as topk_reconstruct_xla

implementation: None (best for the backend: Mosaic on TPU, Triton on GPU, "xla_sparse" on
CPU, the XLA reference wherever the backend's Pallas lowering does not import) | "xla" (the
reference, autodiff end to end: forward mode too, as jax.hessian needs) | "xla_sparse"
(the reference's forward, the kernels' sparse backward from vjp.py: the gradient touches
only the N*k active pairs and the row/column extrema, where autodiff does two N x K x D
matmuls) | "pallas_tpu" | "pallas_gpu" | "pallas_interpret" (the TPU kernel under
interpret=True, for CPU tests).

The kernels (tpu.py, gpu.py) return only the per-row top-k (ids + cosines), the per-row
min squared distance with its arg, and per-prototype maxima/minima over valid tokens with
their token id; the N x K matrix never reaches device memory. The k-row reconstruction
z_hat = sum_j act_j p[idx_j] is done by XLA row gathers (`vjp.gather_mix`: N*k*D work, k/K of
the kernel's, bandwidth-bound, never an N x k x D buffer). Ties: lower prototype id
first, lower token id first for the per-prototype statistics, exactly like the reference.
With `token_axes` (mesh axis names, from the caller's sharding rules) split by an active
mesh, the kernel runs per token shard (sharded.py).

Layout of the op (self-contained: nothing here imports prism_jax):
  reference.py  the pure maths (similarity, mixture weights, extrema, EPS) and the XLA oracle
  api.py        this switch (options.py: the static kernel options)
  launch.py     block sizes, padding and the kernel call (tpu.py Mosaic, gpu.py Triton)
  vjp.py        the sparse custom_vjps (statistics, mixture, whole unsharded layer)
  sharded.py    both mesh paths: tokens split over data axes, the bank split over K
"""

from __future__ import annotations

import functools
import importlib
import typing
from typing import Literal
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels.topk_reconstruct import common, launch, reference, sharded, vjp
from pallas_kernels.topk_reconstruct.options import KernelOptions
from pallas_kernels.topk_reconstruct.reference import mixture_weights

Kernel = Literal["xla", "xla_sparse", "pallas_tpu", "pallas_gpu", "pallas_interpret"]
Implementation = typing.Optional[Kernel]  # None: the best for the backend
IMPLEMENTATIONS = (None,) + typing.get_args(Kernel)


def resolve_implementation(implementation: str | None) -> str:
  """The implementation that will run: None picks by the default backend, and falls back
  to the XLA reference (with a warning) when that backend's Pallas lowering is missing."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; use one of {IMPLEMENTATIONS}")
  if implementation is not None:
    return implementation
  platform = jax.default_backend()
  if platform == "cpu":  # the sparse backward: ~2x less prototype-layer time on CPU
    return "xla_sparse"
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


def kernel_options(implementation: str | None, distance: str) -> KernelOptions | None:
  """Default options of the kernel (or "xla_sparse") `implementation` resolves to; None
  for the XLA reference."""
  impl = resolve_implementation(implementation)
  if impl == "xla":
    return None
  if impl == "xla_sparse":
    return KernelOptions(distance=distance, backend="xla")
  return KernelOptions(distance=distance, backend="gpu" if impl == "pallas_gpu" else "tpu",
                       interpret=impl == "pallas_interpret")


def topk_reconstruct(z_NxD, protos_KxD, k, *, mixture="raw", distance="cosine", mask_N=None,
                     implementation=None, token_axes=(), block_n=None, block_k=None,
                     block_d=None, precision="tf32x3", num_warps=None, num_stages=None):
  """See the module docstring. `token_axes`: the mesh axes the N tokens may be split over
  (() = never split). Blocks, GPU fp32 precision, warps and pipeline stages are tuning
  knobs; None takes the backend's defaults (gpu.default_config, tpu.DEFAULT_*)."""
  impl = resolve_implementation(implementation)
  if impl == "xla" or (impl == "xla_sparse"  # float64 references stay float64, autodiff
                       and reference.wide_dtype(z_NxD, protos_KxD) != jnp.float32):
    return reference.topk_reconstruct_xla(z_NxD, protos_KxD, k, mixture=mixture,
                                          distance=distance, mask_N=mask_N)
  if impl == "xla_sparse":
    return run_with_options(z_NxD, protos_KxD, k, kernel_options(impl, distance),
                            mixture=mixture, mask_N=mask_N, token_axes=token_axes)
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
  return run_with_options(z_NxD, protos_KxD, k, opts, mixture=mixture, mask_N=mask_N,
                          token_axes=token_axes)


def _no_f64(x):
  """float64 (under x64) computed in float32: the kernels and the float32 accumulators of
  the sparse mixture have no float64 variant (gradients flow back as float64). The XLA
  reference (`implementation="xla"`) is dtype-generic and stays in float64."""
  return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def run_with_options(z_NxD, protos_KxD, k, opts: KernelOptions, *, mixture="raw",
                     mask_N=None, token_axes=()):
  """`topk_reconstruct` with explicit kernel options (e.g. the GPU kernel interpreted)."""
  z_NxD, protos_KxD = _no_f64(z_NxD), _no_f64(protos_KxD)
  distance = opts.distance
  n = z_NxD.shape[0]
  valid_N = (jnp.ones((n,), jnp.float32) if mask_N is None
             else mask_N.astype(bool).astype(jnp.float32))
  axes = sharded.active_axes(token_axes, n)
  if axes:  # an active mesh splits the tokens: one kernel per shard (see sharded.py)
    out = sharded.shard_stats(lambda z, p, v: vjp.stats(z, p, v, k, opts), z_NxD,
                              protos_KxD, valid_N, axes, distance == "sqeuclidean")
    out = out[:3] + ((None, out[3], None, out[4]) if distance == "sqeuclidean" else ())
    act = mixture_weights(out[0], mixture)
    z_hat = vjp.gather_mix(act, out[1], protos_KxD, vjp.sequential(opts))  # float32
  else:
    out, act, z_hat = vjp.layer(z_NxD, protos_KxD, valid_N, k, opts, mixture)
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
  out = launch.kernel_stats(z_NxD, protos_KxD, valid_N, k, opts)
  res = (out[1][:, 0], out[3])
  if opts.distance == "sqeuclidean":
    res += (out[5], out[7])
  return res
