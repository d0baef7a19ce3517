"""Tile math shared by the TPU (Mosaic) and GPU (Triton) kernels, and padding helpers.

Both kernels see one tile of raw dot products `dot_BNxBK` (block of tokens x block of
prototypes) and fold it into running per-row state; per-prototype (column) statistics are
written per token block and reduced by XLA afterwards, so nothing of size N x K ever leaves
the chip.

Top-k selection (Pallas has no top_k lowering): the running list of kp >= k entries per
row is kept *unsorted*. A tile is merged by repeatedly taking each row's largest remaining
entry m (lowest prototype id among equal values) and, where m beats the list's minimum,
overwriting the minimum (the entry with the highest id among equal minima). The loop stops
as soon as no row in the block improves, so after the first tiles it runs ~1-3 times per
tile instead of k. Tie-break, same as `lax.top_k` in the reference: equal similarities
go to the lower prototype id. Prototype tiles are visited in increasing id order, so a
strict `>` keeps the earlier (lower) id on ties. XLA sorts the final kp entries.

Ids are carried as float32 inside the kernels (exact below 2**24) so that every reduction
is a plain float max/min, which both Mosaic and Triton lower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
POS_INF = float("inf")
BIG_ID = float(2**24)  # larger than any prototype or token id handled here
MAX_ID = 2**24


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def padded_k(k: int) -> int:
  """Running-list width: a power of two >= max(k, 8) (Triton needs powers of two)."""
  kp = 8
  while kp < k:
    kp *= 2
  return kp


def cos_tile(dot, inv_z_BNx1, inv_p_1xBK):
  """Cosine exactly as the reference computes it: dot * inv|z| * inv|p|."""
  return dot * inv_z_BNx1 * inv_p_1xBK


def sqdist_tile(dot, sq_z_BNx1, sq_p_1xBK):
  return jnp.maximum(sq_z_BNx1 + sq_p_1xBK - 2.0 * dot, 0.0)


def merge_topk(s_BNxBK, col_id_1xBK, vals_BNxKP, ids_BNxKP):
  """Fold a similarity tile into the running unsorted top-kp list (see module docstring).

  Padded columns of `s` must already be -inf. Returns (vals, ids).
  """
  def _max_row(x):
    return jnp.max(x, axis=1, keepdims=True)

  def _min_row(x):
    return jnp.min(x, axis=1, keepdims=True)

  def cond(carry):
    _, _, _, m, kth = carry
    return jnp.max(jnp.where(m > kth, 1.0, 0.0)) > 0.0

  def body(carry):
    s, vals, ids, m, kth = carry
    arg = _min_row(jnp.where(s == m, col_id_1xBK, BIG_ID))  # lowest id among the maxima
    evict = _max_row(jnp.where(vals == kth, ids, -BIG_ID))  # highest id among the minima
    put = (m > kth) & (ids == evict)
    vals = jnp.where(put, m, vals)
    ids = jnp.where(put, arg, ids)
    s = jnp.where(col_id_1xBK == arg, NEG_INF, s)
    return s, vals, ids, _max_row(s), _min_row(vals)

  carry = (s_BNxBK, vals_BNxKP, ids_BNxKP, _max_row(s_BNxBK), _min_row(vals_BNxKP))
  _, vals, ids, _, _ = jax.lax.while_loop(cond, body, carry)
  return vals, ids


def col_best(x_BNxBK, row_id_BNx1, *, largest: bool):
  """Per-column best value over the tile's rows and its lowest row id. Invalid rows must
  already hold -inf (largest) / +inf (smallest)."""
  best = (jnp.max if largest else jnp.min)(x_BNxBK, axis=0, keepdims=True)
  arg = jnp.min(jnp.where(x_BNxBK == best, row_id_BNx1, BIG_ID), axis=0, keepdims=True)
  return best, arg


def row_min_update(x_BNxBK, col_id_1xBK, best_BNx1, arg_BNx1):
  """Running per-row minimum and its lowest column id (strict < keeps earlier ids)."""
  tmin = jnp.min(x_BNxBK, axis=1, keepdims=True)
  targ = jnp.min(jnp.where(x_BNxBK == tmin, col_id_1xBK, BIG_ID), axis=1, keepdims=True)
  better = tmin < best_BNx1
  return jnp.where(better, tmin, best_BNx1), jnp.where(better, targ, arg_BNx1)


def init_list(rows: int, kp: int):
  """Empty running list: -inf values, distinct negative placeholder ids."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (rows, kp), 1).astype(jnp.float32)
  return jnp.full((rows, kp), NEG_INF, jnp.float32), -1.0 - lane


def finish_topk(vals_NxKP, ids_NxKP, k: int):
  """Sort the kernel's unsorted lists (value desc, id asc) and keep k: (sim, idx int32)."""
  neg_vals, ids = jax.lax.sort((-vals_NxKP, ids_NxKP), dimension=1, num_keys=2)
  return -neg_vals[:, :k], ids[:, :k].astype(jnp.int32)


def reduce_cols(best_BxK, arg_BxK, *, largest: bool):
  """Reduce per-token-block column partials (B blocks) to (value, token id int32).
  Ties go to the lowest block, hence to the lowest token id."""
  pick = (jnp.argmax if largest else jnp.argmin)(best_BxK, axis=0)
  best = jnp.take_along_axis(best_BxK, pick[None], axis=0)[0]
  arg = jnp.take_along_axis(arg_BxK, pick[None], axis=0)[0]
  return best, arg.astype(jnp.int32)
