"""Every attribution method as one dense (Q, E) score matrix over the first E training rows.

A training sequence is a packed row (unit="row", kronfluence's example). Sign: positive =
helps the query, for every method (influence.py, influence_full.py, ekfac.py, grad_dot.py).
Queries are `retrain.Queries` (rows with target masks), the same the retrains measure.

  cached PRISM   influence.attribute_batch over an AttributionCache (rank `rank`);
                 sequences sharing no prototype with the query score 0
  full           influence_full.full_scores (path="full": the exact prototype-space score)
  ekfac          ekfac.fit_factors on the E rows, then ekfac.ekfac_scores
  grad_dot       grad_dot.grad_dot_scores (all parameters, no curvature)
  random         iid N(0, 1) scores (seeded): the floor
"""

from __future__ import annotations

import os
import time

import numpy as np

from prism_jax.attribution import cache as cache_lib
from prism_jax.attribution import cache_format
from prism_jax.attribution import ekfac
from prism_jax.attribution import grad_dot
from prism_jax.attribution import influence
from prism_jax.attribution import influence_full

METHODS = ("prism", "full", "ekfac", "grad_dot", "random")


def _dense(ids_E: np.ndarray, scores_QxE: np.ndarray, num_rows: int) -> np.ndarray:
  out = np.zeros((scores_QxE.shape[0], num_rows), np.float64)
  out[:, np.asarray(ids_E, np.int64)] = scores_QxE
  return out


def _prism_queries(queries):
  return [(row[:max(p) + 1], p) for row, p in zip(queries.tokens_QxL, queries.positions)]


def scores(method: str, model, cfg, packed, queries, num_rows: int, scratch: str, *,
           rank: int = 32, seed: int = 0) -> tuple[np.ndarray, float]:
  """(scores_QxE float64, seconds) of `method` on the first `num_rows` training rows.

  `scratch` holds the cache (prism, full share one; built once)."""
  if method not in METHODS:
    raise ValueError(f"unknown attribution method {method!r}; choose from {METHODS}")
  t0 = time.time()
  icfg = influence.InfluenceConfig(unit="row")
  if method in ("prism", "full"):
    cache_dir = os.path.join(scratch, "cache")
    cache = cache_lib.build_cache(model, cfg, packed, cache_dir, cache_lib.CacheConfig(
        rank=rank, max_rows=num_rows), overwrite=True) if not cache_format.is_cache_dir(
            cache_dir) else cache_lib.AttributionCache(cache_dir, model, cfg)
    if method == "prism":
      atts = influence.attribute_batch(model, cache, _prism_queries(queries), cfg=icfg)
      out = np.stack([_dense(a.all_ids, a.all_scores[None], num_rows)[0] for a in atts])
    else:
      ids, sc = influence_full.full_scores(model, cache, packed, _prism_queries(queries),
                                           path="full", cfg=icfg, max_rows=num_rows)
      out = _dense(ids, sc, num_rows)
  elif method == "ekfac":
    batches = lambda: (b for _, b in cache_format.iter_rows(packed, "train", 16, 0, num_rows))
    factors = ekfac.fit_factors(model, batches(), lambda_batches=batches())
    sc, ids = ekfac.ekfac_scores(model, factors, queries.batch(), batches,
                                 train_batch_size=16, by_example=False)
    out = _dense(ids, sc, num_rows)
  elif method == "grad_dot":
    ids, sc = grad_dot.grad_dot_scores(model, queries.batch(), packed, max_rows=num_rows)
    out = _dense(ids, sc, num_rows)
  else:
    out = np.random.default_rng(seed).standard_normal((len(queries.tokens_QxL), num_rows))
  return out, time.time() - t0
