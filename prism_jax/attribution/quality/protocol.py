"""The LDS protocol (PRISM.md §5 quality): which retrains measure an attribution method, in
what order, and what each method's LDS and removal curve are. `experiments.lds` is its
command; the primitives are lds.py (subsets, Spearman, removal sets) and retrain.py.

    p = Protocol(num_rows=2048, subsets=32, alpha=0.5, ceiling_subsets=6,
                 removal_queries=2, removal_m=(16, 32, 64, 128), seed=0)
    scores, seconds = method_scores(["prism", "ekfac"], cfg, packed, queries, p, score_dir,
                                    scratch=out, rank=32)
    run = Retrains(store, cfg, packed, queries, p.num_retrains(["prism", "ekfac"]))
    measured = measure(run, p, scores, removal_methods=["prism", "ekfac"])
    measured.per_query["prism"]     # each query's LDS

`run(name, keep_E, seed)` trains on the rows `keep_E` marks and returns each query's summed
loss (a `Retrains` over a `retrain.RetrainStore`, so an interrupted sweep resumes). The
retrains: the full model at seeds 0 and 1; `subsets` random subsets at `alpha`, seed 0 (the
LDS); the first `ceiling_subsets` of them again at seed 1 (the noise ceiling: the two seeds'
Spearman); for the first `removal_queries` queries, each removal method's top-m rows removed
(m in `removal_m`), seed 0, against the full model's loss.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from prism_jax.attribution.quality import lds, methods, retrain


@dataclasses.dataclass(frozen=True)
class Protocol:
  num_rows: int  # E: the first packed training rows
  subsets: int  # M: LDS subsets, one retrain each
  alpha: float  # the share of rows a subset keeps
  ceiling_subsets: int  # subsets retrained at a second seed (0: no ceiling)
  removal_queries: int  # queries with removal curves
  removal_m: tuple[int, ...]  # rows removed per curve point
  seed: int  # subsets (and the methods' own randomness)

  def num_retrains(self, removal_methods: Sequence[str]) -> int:
    return (2 + self.subsets + self.ceiling_subsets
            + self.removal_queries * len(removal_methods) * len(self.removal_m))


class Retrains:
  """`run(name, keep_E, seed)` over a RetrainStore, with a log line per retrain (done /
  total, its time, the ETA)."""

  def __init__(self, store: retrain.RetrainStore, cfg, packed, queries, total: int):
    self.store, self.cfg, self.packed, self.q = store, cfg, packed, queries
    self.total, self.done, self.spent, self.trained = total, 0, 0.0, 0

  def __call__(self, name: str, keep_E: np.ndarray, seed: int) -> np.ndarray:
    t, fresh = time.time(), not self.store.has(name)
    loss = self.store.run(name, self.cfg, self.packed, np.flatnonzero(keep_E), seed, self.q)
    self.done += 1
    if fresh:
      self.spent, self.trained = self.spent + time.time() - t, self.trained + 1
      eta = self.spent / self.trained * (self.total - self.done)
      logging.info("retrain %d/%d %s: %.1f s (ETA %.0f min)", self.done, self.total, name,
                   time.time() - t, eta / 60)
    return loss


def method_scores(names: Sequence[str], cfg, packed, queries, p: Protocol, score_dir: str, *,
                  scratch: str, rank: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  """Every method's (query, row) scores and seconds, kept as <score_dir>/<name>.npz (a
  rerun reads them); the full model (seed 0 on every row, deterministic) is retrained only
  when some method's scores are missing."""
  scores, cost, model = {}, {}, None
  for name in names:
    path = os.path.join(score_dir, f"{name}.npz")
    if not os.path.exists(path):
      if model is None:
        t = time.time()
        model, _ = retrain.retrain(cfg, packed, np.arange(p.num_rows), 0)
        logging.info("full model trained in %.1f s", time.time() - t)
      sc, sec = methods.scores(name, model, cfg, packed, queries, p.num_rows, scratch,
                               rank=rank, seed=p.seed)
      np.savez(path, scores=sc, seconds=sec)
      logging.info("%s: scores in %.1f s", name, sec)
      # the factors serve every EK-FAC form; another method's row caches need not stay
      methods.BUILDS.keep_only("EK-FAC factors", "prototype cache")
    with np.load(path) as f:
      scores[name], cost[name] = f["scores"], float(f["seconds"])
  return scores, cost


@dataclasses.dataclass(frozen=True)
class Measured:
  full0: np.ndarray  # (Q,) the full model's query losses, seed 0
  full1: np.ndarray  # ... seed 1
  keep: np.ndarray  # (M, E) the LDS subsets
  meas: np.ndarray  # (Q, M) the subsets' query losses, seed 0
  ceiling: tuple[float, float, float] | None  # the two seeds' Spearman: mean, CI
  deltas: dict[str, np.ndarray]  # method -> (removal queries, len(removal_m)) loss change
  per_query: dict[str, np.ndarray]  # method -> (Q,) LDS


def measure(run: Callable[[str, np.ndarray, int], np.ndarray], p: Protocol,
            scores: dict[str, np.ndarray], removal_methods: Sequence[str]) -> Measured:
  """The protocol's retrains through `run` (module doc) and each scored method's per-query
  LDS."""
  everything = np.ones(p.num_rows, bool)
  full0 = run("full_s0", everything, 0)
  full1 = run("full_s1", everything, 1)
  keep = lds.subset_masks(p.num_rows, p.subsets, p.alpha, p.seed)
  meas = np.stack([run(f"lds{m}_s0", keep[m], 0) for m in range(p.subsets)], 1)
  c, ceiling = p.ceiling_subsets, None
  if c:
    meas_b = np.stack([run(f"lds{m}_s1", keep[m], 1) for m in range(c)], 1)
    ceiling = lds.bootstrap_ci(lds.noise_ceiling(meas[:, :c], meas_b))
  deltas = {n: np.zeros((p.removal_queries, len(p.removal_m))) for n in removal_methods}
  for j, m in enumerate(p.removal_m):
    for name in removal_methods:
      for q in range(p.removal_queries):
        loss = run(f"rm_{name}_q{q}_m{m}", lds.removal_keep(scores[name][q], m), 0)
        deltas[name][q, j] = loss[q] - full0[q]
  per_query = {n: lds.lds_per_query(s, keep, meas) for n, s in scores.items()}
  return Measured(full0, full1, keep, meas, ceiling, deltas, per_query)
