"""Every attribution method as one dense (Q, E) score matrix over the first E training rows.

A training sequence is a packed row (unit="row", kronfluence's example). Sign: positive =
helps the query, for every method (influence.py, influence_full.py, ekfac.py, grad_dot.py).
Queries are `retrain.Queries` (rows with target masks), the same the retrains measure.
Each method is a `Method` in REGISTRY (`register(name)` adds one): it takes a `Setting` and
returns (row ids, scores (Q, E')), the one order for all. What a method builds before it
scores (the cache, factors, cached rows, Φ) goes through `Setting.built` into a `Builds`
store: built once per store, its seconds and bytes recorded (experiments/lds_costs.py
reads them to separate build time from per-query time).

  cached PRISM   influence.attribute_batch over an AttributionCache (rank `rank`);
                 sequences sharing no prototype with the query score 0
  full           influence_full.full_scores (path="full": the exact prototype-space score)
  ekfac          ekfac.fit_factors on the E rows, then ekfac.ekfac_scores
  ekfac[GROUP]   the same restricted to a parameter group's layers (bank, last, early,
                 bank+last, last+early: ekfac_group_layers)
  ekfac_cached[GROUP]  ekfac[GROUP] with each row's gradient cached once (whole; "_r1024":
                 projected to 1024 dimensions): a query is one backward pass and a product
  grad_dot       grad_dot.grad_dot_scores (all parameters, no curvature)
  trak           trak.trak_rows + trak_query_scores: gradients projected to 256
                 dimensions, a kernel preconditioner there, an ensemble of 4 projections
                 (one trained model)
  random         iid N(0, 1) scores (seeded): the floor
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Protocol

import numpy as np

from prism_jax.attribution.caching import cache as cache_lib
from prism_jax.attribution.caching import cache_format
from prism_jax.attribution.hessians import ekfac
from prism_jax.attribution.scoring import grad_dot
from prism_jax.attribution.scoring import influence
from prism_jax.attribution.scoring import influence_full
from prism_jax.attribution.scoring import ekfac_cached
from prism_jax.attribution.scoring import trak

@dataclasses.dataclass(frozen=True)
class Setting:
  """What every method scores: `queries` against the first `num_rows` training rows of
  `packed` under `model`; `scratch` holds what a method builds (the cache), `rank` the
  cache's projection, `seed` any randomness."""

  model: Any
  cfg: Any
  packed: Any
  queries: Any
  num_rows: int
  scratch: str
  rank: int = 32
  seed: int = 0
  builds: Builds | None = None  # None: the module's shared store (BUILDS)

  def built(self, what: str, build: Callable[[], Any], nbytes: Callable[[Any], int] = None):
    """`build()`'s result, built once per (what, scratch, model, rows, rank, seed) in
    (self.builds or BUILDS); `nbytes(result)`: what it keeps per training row set."""
    return (self.builds or BUILDS).get(self, what, build, nbytes)


class Builds:
  """What the methods build once and then score every query against (the prototype cache,
  EK-FAC's factors, cached EK-FAC's rows, TRAK's Φ), kept in this process, with each build's
  seconds and bytes: a second `scores` call on the same store pays for its queries alone,
  which is how the attribution cost bench separates build time from per-query time.
  Holds one (scratch, model, data, config, rows) at a time, compared by identity (the store
  keeps them, so a freed model's id cannot come back as another's): a new one drops the old
  builds and their costs."""

  def __init__(self):
    self._owner, self._built = None, {}
    self.seconds: dict[str, float] = {}  # what -> seconds its latest build took
    self.nbytes: dict[str, int] = {}  # what -> bytes it keeps per training-row set

  def get(self, s: Setting, what: str, build: Callable[[], Any],
          nbytes: Callable[[Any], int] | None = None):
    owner = (s.scratch, s.num_rows, s.model, s.packed, s.cfg)
    same = self._owner is not None and self._owner[:2] == owner[:2] and all(
        a is b for a, b in zip(self._owner[2:], owner[2:]))
    if not same:
      self._owner, self._built = owner, {}
      self.seconds, self.nbytes = {}, {}
    key = (what, s.rank, s.seed)
    if key not in self._built:
      t = time.time()
      self._built[key] = build()
      self.seconds[what] = time.time() - t
      self.nbytes[what] = int(nbytes(self._built[key])) if nbytes else 0
    return self._built[key]

  def keep_only(self, *whats: str) -> None:
    """Drops every build but those named (experiments.lds scores method after method in one
    process: the factors are shared, the rows' caches of one method need not outlive it)."""
    self._built = {k: v for k, v in self._built.items() if k[0] in whats}


BUILDS = Builds()


class Method(Protocol):
  """An attribution method: (row ids (E',), scores (Q, E')), positive = helps the query."""

  def __call__(self, setting: Setting) -> tuple[np.ndarray, np.ndarray]: ...


REGISTRY: dict[str, Method] = {}


def register(name: str):
  """Adds a method under `name` (a decorator); `scores(name, ...)` then runs it."""
  def add(fn: Method) -> Method:
    if name in REGISTRY:
      raise ValueError(f"attribution method {name!r} is already registered")
    REGISTRY[name] = fn
    return fn
  return add


def _dense(ids_E: np.ndarray, scores_QxE: np.ndarray, num_rows: int) -> np.ndarray:
  out = np.zeros((scores_QxE.shape[0], num_rows), np.float64)
  out[:, np.asarray(ids_E, np.int64)] = scores_QxE
  return out


def _prism_queries(queries):
  return [(row[:max(p) + 1], p) for row, p in zip(queries.tokens_QxL, queries.positions)]


def _cache(s: Setting):
  """The AttributionCache of the first num_rows rows under scratch (built once, shared by
  prism and full; a cache already on disk is opened, not rebuilt)."""
  cache_dir = os.path.join(s.scratch, "cache")

  def build():
    if cache_format.is_cache_dir(cache_dir):
      cache = cache_lib.AttributionCache(cache_dir, s.model, s.cfg)
      rows = min(s.num_rows, s.packed.num_rows("train"))
      if cache.rank == s.rank and cache.num_sequences("row") == rows:
        return cache  # another rank or row count: built anew below
    return cache_lib.build_cache(s.model, s.cfg, s.packed, cache_dir, cache_lib.CacheConfig(
        rank=s.rank, max_rows=s.num_rows), overwrite=True)
  return s.built("prototype cache", build,
                 lambda c: round(c.nbytes_per_token() * c.num_tokens))


ROW_UNIT = influence.InfluenceConfig(unit="row")  # a training sequence = a packed row


@register("prism")
def _prism(s: Setting):
  """Cached PRISM: influence.attribute_batch over the cache (rows sharing no prototype
  with a query score 0)."""
  atts = influence.attribute_batch(s.model, _cache(s), _prism_queries(s.queries),
                                   cfg=ROW_UNIT)
  return np.arange(s.num_rows), np.stack(
      [_dense(a.all_ids, a.all_scores[None], s.num_rows)[0] for a in atts])


@register("full")
def _full(s: Setting):
  """The exact prototype-space score (influence_full, path="full")."""
  return influence_full.full_scores(s.model, _cache(s), s.packed, _prism_queries(s.queries),
                                    path="full", cfg=ROW_UNIT, max_rows=s.num_rows)


def _ekfac_with(s: Setting, layers=None):
  """EK-FAC factors fitted on the rows (once per scratch and model), then its scores over
  `layers` (None: every linear layer and the bank)."""
  batches = _row_batches(s)
  sc, ids = ekfac.ekfac_scores(s.model, _factors(s), s.queries.batch(), batches,
                               train_batch_size=16, by_example=False, layers=layers)
  return ids, sc


def _row_batches(s: Setting):
  return lambda: (b for _, b in cache_format.iter_rows(s.packed, "train", 16, 0, s.num_rows))


def _factors(s: Setting):
  """EK-FAC's factors on the rows, fitted once per scratch and model (their bytes do not
  grow with the rows: counted as 0 per row)."""
  def fit():
    batches = _row_batches(s)
    return ekfac.fit_factors(s.model, batches(), lambda_batches=batches())
  return s.built("EK-FAC factors", fit)


@register("ekfac")
def _ekfac(s: Setting):
  """EK-FAC factors fitted on the rows, then its scores over every parameter."""
  return _ekfac_with(s)


def ekfac_group_layers(model, group: str) -> list[str]:
  """The EK-FAC layers of a parameter group: "bank", "last" (the final block), "early"
  (every block before it), or several joined by "+" (issue 55's parameter-group LDS)."""
  last = model.cfg.n_layers - 1
  names = ekfac.layer_names(model)
  parts = {"bank": [n for n in names if n == "bank"],
           "last": [n for n in names if n.startswith(f"block{last}.")],
           "early": [n for n in names if n.startswith("block")
                     and not n.startswith(f"block{last}.")]}
  unknown = [g for g in group.split("+") if g not in parts]
  if unknown:
    raise ValueError(f"EK-FAC parameter group {unknown[0]!r}: use bank, last, early or "
                     "several joined by '+'")
  return [n for g in group.split("+") for n in parts[g]]


for _group in ("bank", "last", "early", "bank+last", "last+early"):
  register(f"ekfac[{_group}]")(
      lambda s, g=_group: _ekfac_with(s, ekfac_group_layers(s.model, g)))


def _ekfac_cached(s: Setting, group: str, proj_dim: int = 0):
  """ekfac[GROUP] with the rows' gradients cached once, whole or projected (ekfac_cached)."""
  cfg = ekfac_cached.CachedEkfacConfig(tuple(ekfac_group_layers(s.model, group)),
                                       proj_dim=proj_dim, seed=s.seed)
  factors = _factors(s)
  ids, rows = s.built(f"cached EK-FAC rows [{group}] r{proj_dim}",
                      lambda: ekfac_cached.build_rows(s.model, _row_batches(s)(), cfg),
                      lambda built: built[1].nbytes)
  return ids, ekfac_cached.score_rows(s.model, factors, s.queries.batch(), rows, cfg)


for _group in ("early", "last+early", "bank+last+early"):
  register(f"ekfac_cached[{_group}]")(lambda s, g=_group: _ekfac_cached(s, g))
register("ekfac_cached_r1024[early]")(lambda s: _ekfac_cached(s, "early", 1024))


@register("grad_dot")
def _grad_dot(s: Setting):
  """Gradient dot-products over every parameter, no curvature."""
  return grad_dot.grad_dot_scores(s.model, s.queries.batch(), s.packed, max_rows=s.num_rows)


@register("trak")
def _trak(s: Setting):
  """TRAK: projected per-row gradients, kernel-regression preconditioned (seeded)."""
  cfg = trak.TrakConfig(seed=s.seed)
  rows = s.built("TRAK rows", lambda: trak.trak_rows(s.model, s.packed, max_rows=s.num_rows,
                                                     cfg=cfg),
                 lambda built: built.phi_ExMR.nbytes)  # the projections: fixed, not per row
  return rows.ids_E, trak.trak_query_scores(s.model, s.queries.batch(), rows)


@register("random")
def _random(s: Setting):
  """iid N(0, 1) scores (seeded): the floor."""
  return np.arange(s.num_rows), np.random.default_rng(s.seed).standard_normal(
      (len(s.queries.tokens_QxL), s.num_rows))


METHODS = tuple(REGISTRY)  # the built-in ones, in the tables' order


def scores(method: str, model, cfg, packed, queries, num_rows: int, scratch: str, *,
           rank: int = 32, seed: int = 0, builds: Builds | None = None
           ) -> tuple[np.ndarray, float]:
  """(scores_QxE float64 over the first `num_rows` rows, seconds) of a registered method.

  `scratch` holds the cache (prism and full share one; built once); `builds` keeps what the
  method builds for the next call (default: the module's shared store)."""
  if method not in REGISTRY:
    raise ValueError(f"unknown attribution method {method!r}; choose from {tuple(REGISTRY)}")
  t0 = time.time()
  ids, sc = REGISTRY[method](Setting(model, cfg, packed, queries, num_rows, scratch, rank,
                                     seed, builds))
  return _dense(ids, np.asarray(sc, np.float64), num_rows), time.time() - t0
