"""The CPU-speed path of the op: what XLA:CPU needs to run the XLA statistics fast.

Every piece here computes the same values as reference.py; it only changes how XLA:CPU
schedules them, so it is chosen for the platform being compiled (`on_cpu`, i.e.
`jax.lax.platform_dependent`), never by the process's default backend: a program lowered
for a TPU from a CPU box holds none of it.

  barrier       optimization_barrier on CPU, the identity elsewhere
  top_k         lax.top_k behind a barrier: unfused, XLA:CPU runs its TopK call (a partial
                selection per row); absorbed by a consumer fusion (the mixture's row
                gathers) it falls back to a full O(K log K) sort of every row (~8x at K 8192)
  kernel_stats  the kernels' statistics from the similarity laid out K x N, with
                topk_major's selection over the major axis (the same bits and indices as
                reference.kernel_stats_xla; 1.7-1.9x faster at the byte config,
                benchmarks/bench_topk.py)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.topk_reconstruct import reference, topk_major


# The CPU scheduling helpers live beside the reference (its top-k needs them too).
SCOPE, on_cpu = reference.SCOPE, reference.on_cpu
barrier, top_k = reference.barrier, reference.top_k


class SimilarityKxN(NamedTuple):
  """`reference.Similarity` laid out prototypes x tokens (XLA:CPU's fast layout for the
  top-k and the per-prototype statistics): the same values, transposed."""

  dot_KxN: jax.Array
  sqnorm_z_N: jax.Array
  sqnorm_p_K: jax.Array
  cos_KxN: jax.Array

  def sqdist(self) -> jax.Array:
    return jnp.maximum(self.sqnorm_z_N[None, :] + self.sqnorm_p_K[:, None]
                       - 2.0 * self.dot_KxN, 0.0)


def similarity_KxN(z_NxD: jax.Array, protos_KxD: jax.Array) -> SimilarityKxN:
  """`reference.similarity` transposed: each entry by the same ops in the same order (the
  dot of the same two rows; XLA:CPU's dot gives the same bits in either orientation)."""
  sq_z, sq_p = reference.similarity_terms(z_NxD, protos_KxD)
  dot_KxN = jnp.dot(protos_KxD, z_NxD.T, precision=jax.lax.Precision.HIGHEST)
  inv = reference.inv_norm
  return SimilarityKxN(dot_KxN, sq_z, sq_p, dot_KxN * inv(sq_z)[None, :] * inv(sq_p)[:, None])


def kernel_stats(z_NxD, protos_KxD, valid_N, k: int, distance: str = "cosine"):
  """reference.kernel_stats_xla's tuple, laid out for XLA:CPU (module docstring)."""
  dtype = reference.wide_dtype(z_NxD, protos_KxD)
  z, p = z_NxD.astype(dtype), protos_KxD.astype(dtype)
  if k <= topk_major.MAX_K:
    s, tok = similarity_KxN(z, p), 1  # the token axis of cos and sqdist
    cos = s.cos_KxN
    sim_Nxk, idx_Nxk = topk_major.top_k(cos, k)
  else:
    s, tok = reference.similarity(z, p), 0
    cos = s.cos_NxK
    sim_Nxk, idx_Nxk = top_k(cos, k)
  return reference.stats_from_similarity(s, cos, tok, sim_Nxk, idx_Nxk, valid_N, distance)
