"""Fused sparse top-k prototype reconstruction: the op's one entry point.

    topk_reconstruct(z_NxD, protos_KxD, k, *, mixture, distance, mask_N, implementation,
                     token_axes, model_axis) -> TopKReconstruction
      (idx_Nxk, act_Nxk, sim_Nxk, z_hat_NxD, row_max_cos_N, col_max_cos_K,
       row_min_dist_N, col_min_dist_K)                the reference's contract

implementation: None (the best for the platform the program is compiled for, chosen when
it is lowered: Mosaic on TPU, Triton on GPU, "xla_sparse" on CPU, the XLA reference
elsewhere or where the Pallas lowering does not import; float64 inputs take the reference)
| "xla" (the reference, autodiff end to end: forward mode too, as jax.hessian needs) |
"xla_sparse" (the reference's forward statistics, laid out for XLA:CPU in a program
compiled for CPU (cpu.py), with the kernels' sparse backward from vjp.py: the gradient
touches only the N*k active pairs and the row/column extrema, where autodiff does two
N x K x D matmuls) | "pallas_tpu" | "pallas_gpu" | "pallas_interpret" (the TPU kernel
under interpret=True, for CPU tests).

Mesh paths, chosen here from the active mesh (`jax.set_mesh`) and the caller's axis names
(the caller's sharding rules): with `model_axis` of size > 1 the bank is split over K
(sharded.topk_reconstruct_sharded); otherwise with `token_axes` split by the mesh, the
kernel runs per token shard (sharded.per_token_shard: Pallas kernels are opaque to XLA's
SPMD partitioner).

The kernels (tpu.py, gpu.py) return only the per-row top-k (ids + cosines), the per-row
min squared distance with its arg, and per-prototype maxima/minima over valid tokens with
their token id; the N x K matrix never reaches device memory. The k-row reconstruction
z_hat = sum_j act_j p[idx_j] is done by XLA row gathers (`vjp.gather_mix`: N*k*D work, k/K of
the kernel's, bandwidth-bound, never an N x k x D buffer). Ties: lower prototype id
first, lower token id first for the per-prototype statistics, exactly like the reference.

Layout of the op (self-contained: nothing here imports prism_jax):
  reference.py  the pure maths (similarity, mixture weights, extrema, EPS) and the XLA oracle
  cpu.py        the CPU speed path (K x N statistics, barriers), lowered only for CPU
  api.py        this entry point (options.py: the static kernel options)
  launch.py     block sizes, padding and the kernel call (tpu.py Mosaic, gpu.py Triton)
  vjp.py        the sparse custom_vjps (statistics, mixture, the whole layer)
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
from pallas_kernels.topk_reconstruct.reference import TopKReconstruction

Kernel = Literal["xla", "xla_sparse", "pallas_tpu", "pallas_gpu", "pallas_interpret"]
Implementation = typing.Optional[Kernel]  # None: the best for the platform compiled for
IMPLEMENTATIONS = (None,) + typing.get_args(Kernel)
# What None runs on each lowering platform (others: the XLA reference).
PLATFORM_IMPLEMENTATIONS = {"cpu": "xla_sparse", "tpu": "pallas_tpu", "cuda": "pallas_gpu"}


def check_implementation(implementation: str | None) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; use one of {IMPLEMENTATIONS}")


def resolve_implementation(implementation: str | None, platform: str) -> str:
  """The implementation that runs in a program compiled for `platform` ("cpu", "tpu",
  "cuda", ...): None picks by platform, falling back to the XLA reference (with a
  warning) when that platform's Pallas lowering does not import."""
  check_implementation(implementation)
  if implementation is not None:
    return implementation
  kernel = PLATFORM_IMPLEMENTATIONS.get(platform, "xla")
  if kernel.startswith("pallas") and not _kernel_importable(kernel):
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
                  "layer uses the XLA reference (implementation='xla') there", stacklevel=3)
    return False


def _import_kernel_modules() -> None:
  """Imports the Pallas kernels (and so jax's Pallas modules) now, not while a program is
  traced: Pallas registers trace-context settings on first import, so a jitted function
  traced before that import misses jax's cache on its next call and is traced and compiled
  again (every train step was compiled twice in a fresh process)."""
  for module in ("tpu", "gpu"):
    try:
      importlib.import_module(f"pallas_kernels.topk_reconstruct.{module}")
    except ImportError:  # _kernel_importable warns when that platform is compiled for
      pass


_import_kernel_modules()


def kernel_options(implementation: str, distance: str, **tuning) -> KernelOptions | None:
  """Options of a resolved implementation (None for the XLA reference). `tuning`: blocks,
  GPU precision, warps, stages (options.KernelOptions; None keeps a backend default)."""
  if implementation == "xla":
    return None
  if implementation == "xla_sparse":
    return KernelOptions(distance=distance, backend="xla")
  tuning = {name: v for name, v in tuning.items() if v is not None}
  return KernelOptions(distance=distance,
                       backend="gpu" if implementation == "pallas_gpu" else "tpu",
                       interpret=implementation == "pallas_interpret", **tuning)


def _check(z_NxD, protos_KxD, k, mixture, distance, implementation):
  check_implementation(implementation)
  if mixture not in ("raw", "normalized") or distance not in ("cosine", "sqeuclidean"):
    raise ValueError(f"mixture={mixture!r} / distance={distance!r} not supported")
  if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= protos_KxD.shape[0]:
    raise ValueError(f"k must be an int in [1, K={protos_KxD.shape[0]}], got {k!r}")
  if implementation not in ("xla", "xla_sparse") and (protos_KxD.shape[0] >= common.MAX_ID
                                                      or z_NxD.shape[0] >= common.MAX_ID):
    raise ValueError("N and K must be < 2**24 (ids are exact float32 in the kernel)")


def topk_reconstruct(z_NxD, protos_KxD, k, *, mixture="raw", distance="cosine", mask_N=None,
                     implementation=None, token_axes=(), model_axis=None, block_n=None,
                     block_k=None, block_d=None, precision="tf32x3", num_warps=None,
                     num_stages=None) -> TopKReconstruction:
  """See the module docstring. `token_axes`: the mesh axes the N tokens may be split over
  (() = never split); `model_axis`: the mesh axis the bank may be split over (None =
  never). Blocks, GPU fp32 precision, warps and pipeline stages are tuning knobs; None
  takes the backend's defaults (gpu.default_config, tpu.DEFAULT_*)."""
  _check(z_NxD, protos_KxD, k, mixture, distance, implementation)
  tuning = dict(block_n=block_n, block_k=block_k, block_d=block_d, precision=precision,
                num_warps=num_warps, num_stages=num_stages)
  def run(impl, z, p, mask):
    if impl in ("xla_sparse", None) and reference.wide_dtype(z, p) != jnp.float32:
      impl = "xla"  # float64 references stay float64, autodiff (no float64 kernels)
    opts = kernel_options(impl, distance, **tuning)
    if model_axis is not None and sharded.use_sharded(p.shape[0], model_axis):
      return sharded.topk_reconstruct_sharded(
          z, p, k, model_axis=model_axis, token_axes=token_axes, mixture=mixture,
          distance=distance, mask_N=mask, opts=opts)
    if opts is None:
      return reference.topk_reconstruct_xla(z, p, k, mixture=mixture, distance=distance,
                                            mask_N=mask)
    return run_with_options(z, p, k, opts, mixture=mixture, mask_N=mask,
                            token_axes=token_axes)

  if implementation is not None or reference.wide_dtype(z_NxD, protos_KxD) != jnp.float32:
    return run(implementation or "xla", z_NxD, protos_KxD, mask_N)
  branches = {}
  for platform in PLATFORM_IMPLEMENTATIONS:
    impl = resolve_implementation(None, platform)
    if impl != "xla":
      branches[platform] = functools.partial(run, impl)
  return TopKReconstruction(*jax.lax.platform_dependent(
      z_NxD, protos_KxD, mask_N, default=functools.partial(run, "xla"), **branches))


def _no_f64(x):
  """float64 (under x64) computed in float32: the kernels and the float32 accumulators of
  the sparse mixture have no float64 variant (gradients flow back as float64). The XLA
  reference (`implementation="xla"`) is dtype-generic and stays in float64."""
  return x.astype(jnp.float32) if x.dtype == jnp.float64 else x


def run_with_options(z_NxD, protos_KxD, k, opts: KernelOptions, *, mixture="raw",
                     mask_N=None, token_axes=()):
  """`topk_reconstruct` with explicit kernel options (e.g. the GPU kernel interpreted),
  unsharded or per token shard."""
  z_NxD, protos_KxD = _no_f64(z_NxD), _no_f64(protos_KxD)
  distance = opts.distance
  n = z_NxD.shape[0]
  valid_N = (jnp.ones((n,), jnp.float32) if mask_N is None
             else mask_N.astype(bool).astype(jnp.float32))
  layer = lambda z, p, v: vjp.layer(z, p, v, k, opts, mixture)  # the one composition
  axes = sharded.active_axes(token_axes, n)
  if axes:  # an active mesh splits the tokens: one layer per shard (see sharded.py)
    out, act, z_hat = sharded.per_token_shard(layer, z_NxD, protos_KxD, valid_N, axes,
                                              distance == "sqeuclidean")
  else:
    out, act, z_hat = layer(z_NxD, protos_KxD, valid_N)
  sim, idx, col_max_cos = out[0], out[1], out[2]
  row_max_cos = sim[:, 0]
  if distance == "cosine":
    row_min_dist, col_min_dist = 1.0 - row_max_cos, 1.0 - col_max_cos
  else:
    row_min_dist, col_min_dist = out[4], out[6]
  return TopKReconstruction(idx, act, sim, z_hat, row_max_cos, col_max_cos, row_min_dist,
                            col_min_dist)


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
