"""GPU forward kernel (Pallas Triton lowering; works on jax 0.11 and 0.12, Hopper included).

Triton grid programs run in parallel with no carried state between them, so each program
owns a block of bn tokens and loops over all prototype tiles itself: per tile it
accumulates the (bn x bk) dot over D in bd-wide chunks on the tensor cores, turns it into
cosines, folds it into the running top-kp list held in registers, and writes that tile's
per-column partial maxima for its token block (an (N/bn, K) array). Shapes seen by Triton
are powers of two; the caller pads N, K and D to multiples of the blocks.

Precision: bf16 inputs use bf16 MMA with fp32 accumulation (products are exact, as in the
fp32 reference). fp32 inputs default to 3xTF32 ("tf32x3", ~fp32 accuracy on tensor
cores); "ieee" forces exact fp32 FMA (slow). interpret=True always uses HIGHEST.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.topk_reconstruct import common



class GpuConfig(NamedTuple):
  block_n: int
  block_k: int
  block_d: int
  num_warps: int
  num_stages: int


# Defaults from the H200 block sweep at the XL shape (docs/history/RESULTS-to-2026-12-06.md, "GPU (H200)"):
# 16-bit inputs run (64, 128, 64) with 4 warps and 4 pipeline stages, 1.9x faster than the
# first defaults (64, 64, 64, 4 warps, 2 stages). fp32 keeps those first defaults: its tiles
# take twice the shared memory per stage, and deeper pipelines were not measured for it.
_CONFIG_16BIT = GpuConfig(64, 128, 64, 4, 4)
_CONFIG_FP32 = GpuConfig(64, 64, 64, 4, 2)


def default_config(dtype) -> GpuConfig:
  """Block sizes, warps and pipeline stages used when the caller gives none."""
  return _CONFIG_FP32 if jnp.dtype(dtype) == jnp.float32 else _CONFIG_16BIT
_PRECISIONS = {
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    "highest": jax.lax.Precision.HIGHEST,
}


def _kernel(*refs, num_protos, num_k_tiles, num_d_tiles, bn, bk, bd, kp, sqeuclid,
            precision):
  if sqeuclid:
    (z_ref, p_ref, invz_ref, invp_ref, ok_ref, sqz_ref, sqp_ref,
     vals_ref, ids_ref, cmax_ref, carg_ref, rmin_ref, rarg_ref, cmin_ref, cminarg_ref) = refs
  else:
    (z_ref, p_ref, invz_ref, invp_ref, ok_ref, vals_ref, ids_ref, cmax_ref, carg_ref) = refs
  i = pl.program_id(0)
  rows = pl.ds(pl.multiple_of(i * bn, bn), bn)
  inv_z = invz_ref[rows, :]
  valid = jnp.broadcast_to(ok_ref[rows, :] > 0.0, (bn, bk))
  row_id = (i * bn + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 0)).astype(jnp.float32)
  sq_z = sqz_ref[rows, :] if sqeuclid else None

  def tile(j, carry):
    cols = pl.ds(pl.multiple_of(j * bk, bk), bk)

    def dstep(d, acc):
      ds = pl.ds(pl.multiple_of(d * bd, bd), bd)
      return acc + pltr.dot(z_ref[rows, ds], p_ref[cols, ds], trans_b=True,
                            precision=precision)

    dot = jax.lax.fori_loop(0, num_d_tiles, dstep, jnp.zeros((bn, bk), jnp.float32))
    col_id = (j * bk + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 1)).astype(jnp.float32)
    real_col = col_id < num_protos
    cos = jnp.where(real_col, common.cos_tile(dot, inv_z, invp_ref[:, cols]), common.NEG_INF)
    cmax, carg = common.col_best(jnp.where(valid, cos, common.NEG_INF), row_id, largest=True)
    cmax_ref[pl.ds(i, 1), cols] = cmax
    carg_ref[pl.ds(i, 1), cols] = carg
    vals, ids = common.merge_topk(cos, col_id, carry[0], carry[1])
    if not sqeuclid:
      return vals, ids
    sq = jnp.where(real_col, common.sqdist_tile(dot, sq_z, sqp_ref[:, cols]), common.POS_INF)
    rmin, rarg = common.row_min_update(sq, col_id, carry[2], carry[3])
    cmin, cminarg = common.col_best(jnp.where(valid, sq, common.POS_INF), row_id,
                                    largest=False)
    cmin_ref[pl.ds(i, 1), cols] = cmin
    cminarg_ref[pl.ds(i, 1), cols] = cminarg
    return vals, ids, rmin, rarg

  init = common.init_list(bn, kp)
  if sqeuclid:
    init += (jnp.full((bn, 1), common.POS_INF, jnp.float32),
             jnp.full((bn, 1), common.BIG_ID, jnp.float32))
  out = jax.lax.fori_loop(0, num_k_tiles, tile, init)
  vals_ref[rows, :] = out[0]
  ids_ref[rows, :] = out[1]
  if sqeuclid:
    rmin_ref[rows, :] = out[2]
    rarg_ref[rows, :] = out[3]


def topk_stats_gpu(z_NpxDp, p_KpxDp, inv_z_Npx1, inv_p_1xKp, ok_Npx1, sq_z_Npx1, sq_p_1xKp, *,
                   num_protos: int, kp: int, sqeuclid: bool, block_n: int, block_k: int,
                   block_d: int, num_warps: int, num_stages: int,
                   precision: str = "tf32x3", interpret: bool = False):
  """Padded inputs (multiples of the blocks) -> vals/ids (Np, kp) unsorted, column
  partials (Np/bn, Kp) [and the sqeuclid extras], like `tpu.topk_stats_tpu`."""
  n_pad, d_pad = z_NpxDp.shape
  k_pad = p_KpxDp.shape[0]
  nb = n_pad // block_n
  if z_NpxDp.dtype != jnp.float32:
    prec = None  # bf16/fp16 MMA, fp32 accumulation
  elif interpret:
    prec = jax.lax.Precision.HIGHEST
  else:
    prec = _PRECISIONS[precision]
  f32 = jnp.float32
  # Inside shard_map (check_vma) outputs vary over the same mesh axes as the tokens.
  _sds = functools.partial(jax.ShapeDtypeStruct,
                           manual_axis_type=jax.typeof(z_NpxDp).manual_axis_type)
  args = [z_NpxDp, p_KpxDp, inv_z_Npx1, inv_p_1xKp, ok_Npx1]
  out_shape = [_sds((n_pad, kp), f32)] * 2
  out_shape += [_sds((nb, k_pad), f32)] * 2
  if sqeuclid:
    args += [sq_z_Npx1, sq_p_1xKp]
    out_shape += [_sds((n_pad, 1), f32)] * 2
    out_shape += [_sds((nb, k_pad), f32)] * 2
  kernel = functools.partial(
      _kernel, num_protos=num_protos, num_k_tiles=k_pad // block_k,
      num_d_tiles=d_pad // block_d, bn=block_n, bk=block_k, bd=block_d, kp=kp,
      sqeuclid=sqeuclid, precision=prec)
  itemsize = jnp.dtype(z_NpxDp.dtype).itemsize
  cost = pl.CostEstimate(flops=2 * n_pad * k_pad * d_pad, transcendentals=0,
                         bytes_accessed=itemsize * (n_pad * d_pad + nb * k_pad * d_pad))
  return pl.pallas_call(
      kernel, grid=(nb,), out_shape=out_shape,
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      cost_estimate=cost, interpret=interpret, name="prism_topk_gpu")(*args)
