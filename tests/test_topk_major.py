"""topk_major: the CPU top-k over the major axis is lax.top_k of the transpose, exactly.

Reference: `lax.top_k(x.T, k)` (XLA's TopK call, the order and ties every implementation
documents) and, independently, a NumPy stable sort on the same total-order key. Inputs are
fresh random matrices with many exact ties, signed zeros, infinities, NaNs of both signs
and several payloads, and columns holding nothing but -inf, at shapes that take the direct
passes, one level of group maxima and two, and K not a multiple of the group width.
Also: `cpu.similarity_KxN` is `reference.similarity` transposed to the bit, `cpu.kernel_stats`
(the CPU statistics) equals `reference.kernel_stats_xla` to the bit, and
benchmarks.bench_topk refuses an unknown shape.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_reconstruct import cpu, reference, topk_major


def _nasty(rng, rows: int, cols: int, dtype=np.float32) -> np.ndarray:
  x = np.round(rng.normal(size=(rows, cols)), 1).astype(dtype)  # many exact ties
  for value, share in ((0.0, 0.08), (-0.0, 0.08), (np.inf, 0.02), (-np.inf, 0.1)):
    x[rng.random(x.shape) < share] = value
  ints = {np.float32: np.uint32, np.float64: np.uint64}[dtype]
  sign = ints(1) << ints(8 * x.itemsize - 1)
  nan = np.asarray(np.nan, dtype).view(ints)
  flat = x.reshape(-1).view(ints)
  spots = rng.choice(flat.size, 6, replace=False)
  flat[spots[:2]] = nan + ints(1)  # NaNs with payloads, of both signs
  flat[spots[2:4]] = (nan + ints(7)) | sign
  flat[spots[4]] = nan | sign
  flat[spots[5]] = ~ints(0)  # all bits set: the smallest key there is
  x[:, 0] = -np.inf  # a column with nothing but -inf
  return x


def _numpy_top_k(x_KxN: np.ndarray, k: int):
  """Each column sorted by descending total-order key, then ascending row (NumPy lexsort;
  ~key is the key reversed without overflow)."""
  ints = {4: np.int32, 8: np.int64}[x_KxN.itemsize]
  bits = x_KxN.view(ints)
  key = np.where(bits < 0, bits ^ np.iinfo(ints).max, bits)
  rows = np.broadcast_to(np.arange(key.shape[0])[:, None], key.shape)
  order = np.lexsort((rows, ~key), axis=0)[:k]
  return np.take_along_axis(x_KxN, order, 0).T, order.T


@pytest.mark.parametrize("rows,cols,k", [(48, 37, 5),      # direct passes
                                         (256, 33, 3),     # one level of group maxima
                                         (2048, 9, 4),     # two levels
                                         (260, 17, 6),     # K % 8 != 0: direct
                                         (512, 20, 8)])    # the byte config's K and k
def test_equals_lax_top_k_of_the_transpose(rows, cols, k):
  rng = np.random.default_rng(rows + cols + k)
  x = _nasty(rng, rows, cols)
  vals, idx = jax.jit(topk_major.top_k, static_argnums=1)(x, k)
  ref_vals, ref_idx = jax.lax.top_k(jnp.asarray(x).T, k)
  np_vals, np_idx = _numpy_top_k(x, k)
  assert idx.dtype == jnp.int32 and vals.shape == (cols, k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  np.testing.assert_array_equal(np.asarray(idx), np_idx)
  # bit for bit: signed zeros and NaN payloads included
  np.testing.assert_array_equal(np.asarray(vals).view(np.uint32), np.asarray(ref_vals).view(np.uint32))
  np.testing.assert_array_equal(np.asarray(vals).view(np.uint32), np_vals.view(np.uint32))


def test_ties_inside_and_across_groups_go_to_the_lower_row():
  x = np.zeros((512, 4), np.float32)
  x[[3, 5, 100, 101, 400], :] = 1.0  # five equal maxima in four groups
  x[[7, 300], :] = 0.5
  _, idx = topk_major.top_k(x, 6)
  np.testing.assert_array_equal(np.asarray(idx), np.tile([3, 5, 100, 101, 400, 7], (4, 1)))
  # A tie whose lower row sits in the group with the smaller maximum: group 0 holds only
  # 1.0 (row 1), group 5 holds 2.0 (row 40) and 1.0 (row 41).
  x = np.zeros((512, 3), np.float32)
  x[1], x[40], x[41] = 1.0, 2.0, 1.0
  _, idx = topk_major.top_k(x, 3)
  np.testing.assert_array_equal(np.asarray(idx), np.tile([40, 1, 41], (3, 1)))


def test_float64_under_x64():
  rng = np.random.default_rng(11)
  x = _nasty(rng, 256, 7, np.float64)
  with jax.enable_x64(True):
    vals, idx = topk_major.top_k(jnp.asarray(x), 4)
    ref_vals, ref_idx = jax.lax.top_k(jnp.asarray(x).T, 4)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  np.testing.assert_array_equal(np.asarray(vals).view(np.uint64), np.asarray(ref_vals).view(np.uint64))
  np.testing.assert_array_equal(np.asarray(idx), _numpy_top_k(x, 4)[1])


def test_large_k_is_the_topk_call_and_bad_k_is_refused():
  x = np.random.default_rng(2).normal(size=(64, 10)).astype(np.float32)
  k = topk_major.MAX_K + 1
  vals, idx = topk_major.top_k(x, k)
  ref_vals, ref_idx = jax.lax.top_k(x.T, k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
  for bad in (0, 65):
    with pytest.raises(ValueError, match=r"k=.* must be in \[1, 64\]"):
      topk_major.top_k(x, bad)


def test_no_topk_call_or_sort_in_the_compiled_selection():
  x = jnp.asarray(np.random.default_rng(4).normal(size=(512, 64)), jnp.float32)
  hlo = jax.jit(topk_major.top_k, static_argnums=1).lower(x, 8).compile().as_text()
  assert 'custom_call_target="TopK"' not in hlo and " sort(" not in hlo


@pytest.mark.parametrize("n,num_protos,d", [(768, 512, 128), (37, 48, 16), (100, 300, 33)])
def test_similarity_KxN_is_similarity_transposed_to_the_bit(n, num_protos, d):
  rng = np.random.default_rng(n)
  z = rng.normal(size=(n, d)).astype(np.float32)
  p = rng.normal(size=(num_protos, d)).astype(np.float32)
  z[1] = 0.0  # a zero row: the EPS guard
  p[2] = p[5]  # duplicate prototypes: exact ties
  a = jax.jit(reference.similarity)(z, p)
  b = jax.jit(cpu.similarity_KxN)(z, p)
  np.testing.assert_array_equal(np.asarray(b.dot_KxN).T, np.asarray(a.dot_NxK))
  np.testing.assert_array_equal(np.asarray(b.cos_KxN).T, np.asarray(a.cos_NxK))
  np.testing.assert_array_equal(np.asarray(b.sqdist()).T, np.asarray(a.sqdist()))


def test_bench_topk_refuses_an_unknown_shape():
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-m", "benchmarks.bench_topk", "--shapes=byte,huge"],
                       cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert res.returncode == 2
  assert res.stderr.strip().splitlines()[-1] == (
      "error: --shapes: unknown ['huge']; choose from ['byte', 'small']")


@pytest.mark.parametrize("distance,k", [("cosine", 5), ("sqeuclidean", 8),
                                        ("sqeuclidean", topk_major.MAX_K + 1)])
def test_cpu_statistics_equal_the_reference_statistics_to_the_bit(distance, k):
  """cpu.kernel_stats (K x N layout, topk_major; lax.top_k behind a barrier above MAX_K)
  against reference.kernel_stats_xla (N x K, lax.top_k): the same values and ids."""
  rng = np.random.default_rng(k)
  z = rng.normal(size=(70, 12)).astype(np.float32)
  p = rng.normal(size=(90, 12)).astype(np.float32)
  p[4] = p[40]  # exact ties
  valid = jnp.asarray(rng.random(70) > 0.3, jnp.float32)
  got = jax.jit(lambda *a: cpu.kernel_stats(*a, k, distance))(z, p, valid)
  want = jax.jit(lambda *a: reference.kernel_stats_xla(*a, k, distance))(z, p, valid)
  assert len(got) == len(want) == (8 if distance == "sqeuclidean" else 4)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
