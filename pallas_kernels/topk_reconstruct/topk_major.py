"""Exact top-k along the major axis by plain reductions: XLA:CPU's fast layout for it.

XLA:CPU runs `lax.top_k` as its TopK custom call, one partial selection per row on one
thread, 1.4-1.7 ms for 768 x 512 at k 8 (docs/history/RESULTS-to-2026-12-06.md, round 4;
this selection: 0.6 ms, benchmarks/bench_topk.py), while a
max over the major axis of a K x N matrix is an elementwise max of K rows of N, fully
vectorised. So the prototype layer's CPU forward keeps its similarities as K x N (one
prototype per row, `cpu.similarity_KxN`) and selects per column:

  1. group maxima: the max of each run of G consecutive rows (one pass over the matrix);
  2. the top k groups of every column (recursively, on the K / G group maxima);
  3. the k G candidates of those groups, in row order, and their top k by k passes of
     "max, then the lowest row holding it", each masking the row it took.

Exact: the k largest entries (ties to the lower row) lie in the k groups with the largest
maxima (ties to the lower group): for an entry outside them, k groups each hold a larger
one. Order and ties are lax.top_k's: a total-order integer key (-0.0 below +0.0, NaN by
sign and payload, as the TopK call's comparator) and the lowest row among equal keys.
`top_k(x_KxN, k)` returns what `lax.top_k(x_KxN.T, k)` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 8  # rows per group of step 1: of 8, 16, 32 the fastest at K 512 and 8192
# (benchmarks/bench_topk.py)
MAX_K = 32  # the passes beat the TopK call up to k 32 (768 x 512, 256 x 8192); at 64 they
# take 1.4x its time


def total_order_key(x: jax.Array) -> jax.Array:
  """Signed integers ordered as lax.top_k orders floats (its total order)."""
  int_dtype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, int_dtype)
  return jnp.where(bits < 0, bits ^ jnp.iinfo(int_dtype).max, bits)


def _passes(key_RxN: jax.Array, k: int) -> jax.Array:
  """Rows of the k largest keys of every column, largest first, ties to the lower row:
  (k, N) int32. A `taken` mask, not a sentinel key, marks picked rows (every key value
  is some float's)."""
  rows = key_RxN.shape[0]
  iota = jax.lax.broadcasted_iota(jnp.int32, key_RxN.shape, 0)
  floor = jnp.iinfo(key_RxN.dtype).min
  taken = jnp.zeros(key_RxN.shape, bool)
  picks = []
  for _ in range(k):
    best = jnp.max(jnp.where(taken, floor, key_RxN), 0)
    pick = jnp.min(jnp.where((key_RxN == best) & ~taken, iota, rows), 0)
    picks.append(pick)
    # Materialised per pass: fused, every pass would recompute all earlier masks. (This
    # module is the CPU path's, cpu.py; it is lowered only in programs compiled for CPU.)
    taken = jax.lax.optimization_barrier(taken | (iota == pick))
  return jnp.stack(picks)


def _ascending(ids_kxN: jax.Array) -> jax.Array:
  """Each column of distinct ids sorted ascending (k x k comparisons: k is small)."""
  k = ids_kxN.shape[0]
  rank = jnp.sum(ids_kxN[None, :, :] < ids_kxN[:, None, :], 1)  # rank of each id in its column
  slot = rank[:, None, :] == jnp.arange(k, dtype=rank.dtype)[None, :, None]
  return jnp.sum(jnp.where(slot, ids_kxN[:, None, :], 0), 0)


def _top_rows(key_RxN: jax.Array, k: int) -> jax.Array:
  """`_passes`' result, through group maxima when the matrix is large enough to gain."""
  rows, n = key_RxN.shape
  if rows % GROUP or rows < 4 * GROUP * k:
    return _passes(key_RxN, k)
  groups = _ascending(_top_rows(jnp.max(key_RxN.reshape(rows // GROUP, GROUP, n), 1), k))
  cand = (groups[:, None, :] * GROUP
          + jnp.arange(GROUP, dtype=groups.dtype)[None, :, None]).reshape(k * GROUP, n)
  return jnp.take_along_axis(cand, _passes(jnp.take_along_axis(key_RxN, cand, 0), k), 0)


def top_k(x_KxN: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(values, indices), both (N, k): the k largest entries of every column of x_KxN,
  largest first, ties to the lower row: `lax.top_k(x_KxN.T, k)`'s values and int32
  indices. For k > MAX_K it is that call."""
  if not 1 <= k <= x_KxN.shape[0]:
    raise ValueError(f"top_k: k={k} must be in [1, {x_KxN.shape[0]}] (rows of x)")
  if k > MAX_K:
    vals, idx = jax.lax.top_k(x_KxN.T, k)
    return vals, idx.astype(jnp.int32)
  idx_kxN = _top_rows(total_order_key(x_KxN), k)
  return jnp.take_along_axis(x_KxN, idx_kxN, 0).T, idx_kxN.T
