"""EK-FAC on a parameter group, cached per training row (issue 55's hybrid, first form).

EK-FAC scores a query by streaming every training row through a backward pass
(hessians/ekfac.py), so each query costs a pass over the data. Here that pass is made once:
each training row's gradient on the chosen layers G_t (their EK-FAC layers: whole blocks
and/or the bank) is flattened, optionally projected to R dimensions by a seeded Gaussian S
(P_g x R, N(0, 1/R)), and kept: (E, P_g) whole, (E, R) projected. A query then costs one backward pass, EK-FAC's
preconditioner on its gradient and an (R x E) product:

    score(q, t) = ⟨S precondition(G_q), S G_t⟩ ≈ ⟨precondition(G_q), G_t⟩   (ekfac[GROUP])

(exact at R = 0, the default: no projection, the rows' gradients kept whole; 4 bytes × P_g
per row, e.g. 0.2 MB for one block of the LDS recipe). **Sign: positive = the
training sequence helps the query.** Training sequences are rows (the LDS unit).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from prism_jax.attribution.hessians import ekfac
from prism_jax.attribution.hessians.ekfac_capture import (Capture, _capture,
                                                         per_sequence_grads, segment_weights)

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class CachedEkfacConfig:
  layers: tuple[str, ...]  # EK-FAC layer names (ekfac.layer_names), whole blocks
  # R; 0 keeps the gradients whole (exact). Projecting destroys the score at the LDS recipe
  # (R 1024: LDS 0.03 against 0.36 whole, docs/RESULTS.md): a query's and a row's gradients
  # are nearly orthogonal, so the projection's noise (~ |q| |g| / √R) swamps their product.
  proj_dim: int = 0
  seed: int = 0


def _flat(grads: dict, names) -> jax.Array:
  """(S, B, P_g): the layers' per-sequence gradients side by side."""
  return jnp.concatenate([grads[n].reshape(grads[n].shape[:2] + (-1,)) for n in names], -1)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _row_features(graphdef, names, state, proj, tokens_BxT, labels_BxT, weight_SxBxT):
  deltas, acts = _capture(graphdef, names, state, tokens_BxT, labels_BxT, weight_SxBxT)
  g = _flat(per_sequence_grads(Capture(acts, deltas)), names)
  return g if proj is None else jnp.matmul(g, proj, precision=_HI)


def projection(cfg: CachedEkfacConfig, num_params: int):
  if not cfg.proj_dim:
    return None
  return (jax.random.normal(jax.random.key(cfg.seed), (num_params, cfg.proj_dim), jnp.float32)
          / np.sqrt(cfg.proj_dim))


def _group_size(split, names) -> int:
  batch = {"inputs": np.zeros((1, 2), np.int32), "targets": np.zeros((1, 2), np.int32),
           "mask": np.ones((1, 2), bool)}
  w, _ = segment_weights({**batch, "row_id": np.zeros(1, np.int64)}, False)
  g = _row_features(split.graphdef, tuple(names), split.state, None,
                    jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"]),
                    jnp.asarray(w, split.dtype))
  return int(g.shape[-1])


def build_rows(model, train_batches, cfg: CachedEkfacConfig, dtype=None
               ) -> tuple[np.ndarray, np.ndarray]:
  """(row ids (E,), features (E, R or P_g)): every training row's projected gradient, over
  `train_batches` (batches of the batch contract, row_id set); `dtype` as ekfac's."""
  ekfac_split = ekfac.split_model(model, dtype)
  names = tuple(cfg.layers)
  proj = projection(cfg, _group_size(ekfac_split, names))
  ids, feats = [], []
  for batch in train_batches:
    w, seg = segment_weights(batch, by_example=False)
    f = _row_features(ekfac_split.graphdef, names, ekfac_split.state, proj,
                      jnp.asarray(batch["inputs"], jnp.int32),
                      jnp.asarray(batch["targets"], jnp.int32),
                      jnp.asarray(w, ekfac_split.dtype))
    keep = seg[0] >= 0
    feats.append(np.asarray(f[0])[keep])
    ids.append(seg[0][keep])
  return np.concatenate(ids), np.concatenate(feats)


def query_features(model, factors: ekfac.Factors, query: dict, cfg: CachedEkfacConfig,
                   dtype=None) -> np.ndarray:
  """(Q, R or P_g): each query row's preconditioned gradient on the layers, projected."""
  split = ekfac.split_model(model, dtype)
  names = tuple(cfg.layers)
  fac = [{n: d[n] for n in names} for d in (factors.q_a, factors.q_s, factors.lam,
                                           factors.damping)]
  pre = ekfac._query_step(split.graphdef, names, split.state, *fac,  # pylint: disable=protected-access
                          jnp.asarray(query["inputs"], jnp.int32),
                          jnp.asarray(query["targets"], jnp.int32),
                          jnp.asarray(query["mask"], split.dtype))
  flat = _flat({n: pre[n][None] for n in names}, names)[0]
  proj = projection(cfg, flat.shape[-1])
  return np.asarray(flat if proj is None else jnp.matmul(flat, proj, precision=_HI))


def score_rows(model, factors: ekfac.Factors, query: dict, rows_ExR: np.ndarray,
               cfg: CachedEkfacConfig, dtype=None) -> np.ndarray:
  """(Q, E) float64: every query row of `query` scored against the cached rows (build_rows,
  the same `cfg`)."""
  q = query_features(model, factors, query, cfg, dtype)
  return np.asarray(q, np.float64) @ np.asarray(rows_ExR, np.float64).T


def cached_ekfac_scores(model, factors: ekfac.Factors, query: dict, train_batches,
                        cfg: CachedEkfacConfig, dtype=None) -> tuple[np.ndarray, np.ndarray]:
  """(ids_E, scores_QxE): the rows' cache built, then every query scored against it."""
  t0 = time.time()
  ids, rows = build_rows(model, train_batches, cfg, dtype)
  t1 = time.time()
  scores = score_rows(model, factors, query, rows, cfg, dtype)
  logging.info("cached EK-FAC %s: rows cached in %.1f s (%d x %d), %d queries scored in "
               "%.2f s", "+".join(cfg.layers), t1 - t0, *rows.shape, len(scores),
               time.time() - t1)
  return ids, scores
