"""Launching the Pallas kernels (tpu.py, gpu.py) on padded operands.

`kernel_stats` resolves the block sizes (clipped to the problem, checked against what each
backend can tile), pads z and the bank to whole blocks, runs the kernel and finishes its
partial outputs (sorted top-k, per-prototype extrema reduced over token blocks). Its
gradients are vjp.py's; the implementation switch is api.py's.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.topk_reconstruct import common, reference
from pallas_kernels.topk_reconstruct.options import KernelOptions

KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


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


def norms(x_f32):
  """(|x|^2, 1/max(|x|, EPS)) per row, as reference.similarity guards them."""
  sq = jnp.sum(x_f32 * x_f32, axis=-1)
  return sq, reference.inv_norm(sq)


def kernel_stats(z_NxD, p_KxD, valid_N, k: int, opts: KernelOptions):
  """Runs the kernel; returns (sim_Nxk, idx_Nxk, col_max_cos_K, col_arg_cos_K) plus, for
  sqeuclidean, (row_min_sq_N, row_arg_sq_N, col_min_sq_K, col_arg_sq_K)."""
  n, d = z_NxD.shape
  num_protos = p_KxD.shape[0]
  dtype = z_NxD.dtype if z_NxD.dtype == p_KxD.dtype else jnp.float32
  if dtype not in KERNEL_DTYPES:
    dtype = jnp.float32
  sq_z, inv_z = norms(z_NxD.astype(jnp.float32))
  sq_p, inv_p = norms(p_KxD.astype(jnp.float32))
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
