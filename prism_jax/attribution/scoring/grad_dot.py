"""Gradient-dot attribution (TracIn at the final checkpoint; Pruthi et al. 2020).

    score(q, t) = ∇_θ L_qᵀ ∇_θ L_t

over every parameter θ of the real model, L = the token CE (losses.token_nll) summed over a
sequence's loss tokens (the query's target tokens; a training row's `mask`). No curvature:
it is the identity-preconditioned baseline of EK-FAC (ekfac.py) and of the cached PRISM
score (influence.py). **Sign: positive = the training sequence helps the query** (a
gradient step on t lowers L_q to first order), the convention of every method here.

Per-sequence gradients come from jax.vmap(jax.grad) over the rows of a batch, flattened
to (B, P) and dotted with the (Q, P) query gradients; memory ∝ (Q + batch_rows) × P.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prism_jax import losses
from prism_jax.attribution.caching import cache_format
from prism_jax.data import batch as batch_lib


def flat_grads(graphdef, params, rest, inputs_BxT, targets_BxT, mask_BxT):
  """(B, P) float32: per row, the gradient of its summed masked CE w.r.t. every Param."""

  def one(inputs_T, targets_T, mask_T):
    def loss(p):
      model = nnx.merge(graphdef, p, rest)
      out = model(inputs_T[None], mask_BxT=mask_T[None])
      nll_T = losses.token_nll(out.logits_BxTxV[0], targets_T)
      return jnp.sum(nll_T * mask_T.astype(nll_T.dtype))
    g = jax.grad(loss)(params)
    return jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in jax.tree.leaves(g)])

  return jax.vmap(one)(inputs_BxT, targets_BxT, mask_BxT)


@functools.partial(jax.jit, static_argnums=0)
def _query_grads(graphdef, params, rest, inputs_BxT, targets_BxT, mask_BxT):
  return flat_grads(graphdef, params, rest, inputs_BxT, targets_BxT, mask_BxT)


@functools.partial(jax.jit, static_argnums=0)
def _chunk_scores(graphdef, params, rest, q_QxP, inputs_BxT, targets_BxT, mask_BxT):
  g_BxP = flat_grads(graphdef, params, rest, inputs_BxT, targets_BxT, mask_BxT)
  return q_QxP @ g_BxP.T


def device_batch(batch):
  return (jnp.asarray(batch["inputs"], jnp.int32), jnp.asarray(batch["targets"], jnp.int32),
          jnp.asarray(batch["mask"], bool))


def query_gradients(model, query: dict[str, np.ndarray], batch_rows: int = 16) -> jax.Array:
  """(Q, P) flattened gradients of each query row's summed CE over query["mask"]."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  num_q = len(query["inputs"])
  if num_q == 0:
    raise ValueError("grad_dot needs at least one query row")
  parts = []
  for start in range(0, num_q, batch_rows):
    chunk = {k: np.asarray(query[k])[start:start + batch_rows]
             for k in ("inputs", "targets", "mask")}
    parts.append(_query_grads(graphdef, params, rest, *device_batch(
        batch_lib.pad_batch(chunk, batch_rows)))[:len(chunk["inputs"])])
  return jnp.concatenate(parts)


def grad_dot_scores(model, query: dict[str, np.ndarray], packed, *, split: str = "train",
                    max_rows: int | None = None, batch_rows: int = 16
                    ) -> tuple[np.ndarray, np.ndarray]:
  """(ids_E, scores_QxE): the gradient dot of every training row (ids = row ids, the
  first `max_rows` rows of `split`) with every query row of the batch `query`."""
  if batch_rows <= 0:
    raise ValueError(f"batch_rows must be positive, got {batch_rows}")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  q_QxP = query_gradients(model, query, batch_rows)
  ids, cols = [], []
  for start, batch in cache_format.iter_rows(packed, split, batch_rows, 0, max_rows):
    n = len(batch["inputs"])
    s_QxB = _chunk_scores(graphdef, params, rest, q_QxP,
                          *device_batch(batch_lib.pad_batch(batch, batch_rows)))
    cols.append(np.asarray(s_QxB, np.float64)[:, :n])
    ids.append(np.arange(start, start + n))
  if not ids:
    raise ValueError(f"split {split!r} has no rows to score")
  return np.concatenate(ids), np.concatenate(cols, 1)
