"""TPU (Mosaic) forward kernel: grid (token blocks, prototype blocks), prototypes innermost.

Per grid step the MXU computes one (bn x bk) dot tile from a (bn, D) token block and a
(bk, D) prototype block held in VMEM; the tile is turned into cosines, folded into the
per-row running top-kp list (an output block that stays resident across the prototype
axis) and reduced to per-column partial maxima, which are written per token block as a
(nb, 1, K) array (N/bn x K: 1/bn of the N x K matrix). XLA sorts the kp survivors and
reduces the column partials. `interpret=True` runs the same kernel on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.topk_reconstruct import common

DEFAULT_BLOCK_N = 256
DEFAULT_BLOCK_K = 256


def _kernel(*refs, num_protos, bn, bk, sqeuclid, precision):
  if sqeuclid:
    (z_ref, p_ref, invz_ref, invp_ref, ok_ref, sqz_ref, sqp_ref,
     vals_ref, ids_ref, cmax_ref, carg_ref, rmin_ref, rarg_ref, cmin_ref, cminarg_ref) = refs
  else:
    (z_ref, p_ref, invz_ref, invp_ref, ok_ref, vals_ref, ids_ref, cmax_ref, carg_ref) = refs
  i, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    vals_ref[...], ids_ref[...] = common.init_list(bn, vals_ref.shape[1])
    if sqeuclid:
      rmin_ref[...] = jnp.full(rmin_ref.shape, common.POS_INF, jnp.float32)
      rarg_ref[...] = jnp.full(rarg_ref.shape, common.BIG_ID, jnp.float32)

  dot = jax.lax.dot_general(z_ref[...], p_ref[...], (((1,), (1,)), ((), ())),
                            precision=precision, preferred_element_type=jnp.float32)
  col_id = (j * bk + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 1)).astype(jnp.float32)
  row_id = (i * bn + jax.lax.broadcasted_iota(jnp.int32, (bn, bk), 0)).astype(jnp.float32)
  real_col = col_id < num_protos
  valid = jnp.broadcast_to(ok_ref[...] > 0.0, (bn, bk))

  cos = jnp.where(real_col, common.cos_tile(dot, invz_ref[...], invp_ref[...]), common.NEG_INF)
  cmax_ref[...], carg_ref[...] = common.col_best(
      jnp.where(valid, cos, common.NEG_INF), row_id, largest=True)
  vals_ref[...], ids_ref[...] = common.merge_topk(cos, col_id, vals_ref[...], ids_ref[...])

  if sqeuclid:
    sq = jnp.where(real_col, common.sqdist_tile(dot, sqz_ref[...], sqp_ref[...]),
                   common.POS_INF)
    rmin_ref[...], rarg_ref[...] = common.row_min_update(sq, col_id, rmin_ref[...],
                                                         rarg_ref[...])
    cmin_ref[...], cminarg_ref[...] = common.col_best(
        jnp.where(valid, sq, common.POS_INF), row_id, largest=False)


def topk_stats_tpu(z_NpxD, p_KpxD, inv_z_Npx1, inv_p_1xKp, ok_Npx1, sq_z_Npx1, sq_p_1xKp, *,
                   num_protos: int, kp: int, sqeuclid: bool, block_n: int, block_k: int,
                   interpret: bool = False):
  """Padded inputs (Np % block_n == 0, Kp % block_k == 0) -> raw kernel outputs:
  vals/ids (Np, kp) unsorted, column partials (Np/bn, 1, Kp) [and the sqeuclid extras]."""
  n_pad, d = z_NpxD.shape
  k_pad = p_KpxD.shape[0]
  nb, kb = n_pad // block_n, k_pad // block_k
  precision = (jax.lax.Precision.HIGHEST if z_NpxD.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  row = lambda shape: pl.BlockSpec(shape, lambda i, j: (i, 0))
  col = lambda shape: pl.BlockSpec(shape, lambda i, j: (0, j))
  part = pl.BlockSpec((None, 1, block_k), lambda i, j: (i, 0, j))
  in_specs = [row((block_n, d)), pl.BlockSpec((block_k, d), lambda i, j: (j, 0)),
              row((block_n, 1)), col((1, block_k)), row((block_n, 1))]
  args = [z_NpxD, p_KpxD, inv_z_Npx1, inv_p_1xKp, ok_Npx1]
  f32 = jnp.float32
  # Inside shard_map (check_vma) outputs vary over the same mesh axes as the tokens.
  _sds = functools.partial(jax.ShapeDtypeStruct,
                           manual_axis_type=jax.typeof(z_NpxD).manual_axis_type)
  out_shape = [_sds((n_pad, kp), f32), _sds((n_pad, kp), f32),
               _sds((nb, 1, k_pad), f32),
               _sds((nb, 1, k_pad), f32)]
  out_specs = [row((block_n, kp)), row((block_n, kp)), part, part]
  if sqeuclid:
    in_specs += [row((block_n, 1)), col((1, block_k))]
    args += [sq_z_Npx1, sq_p_1xKp]
    out_shape += [_sds((n_pad, 1), f32)] * 2
    out_shape += [_sds((nb, 1, k_pad), f32)] * 2
    out_specs += [row((block_n, 1)), row((block_n, 1)), part, part]
  kernel = functools.partial(_kernel, num_protos=num_protos, bn=block_n, bk=block_k,
                             sqeuclid=sqeuclid, precision=precision)
  itemsize = jnp.dtype(z_NpxD.dtype).itemsize
  # the MXU dots and the two large streams: z once (its block stays across the prototype
  # axis), the bank once per token block, or once in all when it is one block (the
  # pipeline copies a block only when its index changes); tests/test_kernel_cost.py counts
  # both from the grid
  bank_copies = nb if kb > 1 else 1
  cost = pl.CostEstimate(flops=2 * n_pad * k_pad * d, transcendentals=0,
                         bytes_accessed=itemsize * (n_pad * d + bank_copies * k_pad * d))
  return pl.pallas_call(
      kernel, grid=(nb, kb), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary")),
      cost_estimate=cost, interpret=interpret, name="prism_topk_tpu")(*args)
