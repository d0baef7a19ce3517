"""The linear datamodeling score (LDS; Park et al. 2023, as kronfluence and dattri compute
it) and the removal sets of removal-and-retrain curves.

Scores follow every attribution method here: s[q, e] > 0 means training sequence e helps
query q (training on it lowers the query loss). A linear datamodel then predicts the query
loss of a model trained on subset S as c − Σ_{e∈S} s[q, e], so

    predicted[q, m] = −Σ_e s[q, e] · keep[m, e]      (the sign makes a good method's LDS > 0)
    LDS[q]          = Spearman_m(predicted[q, m], measured[q, m])

where measured[q, m] is the query's summed loss under the model retrained on subset m.
The reported LDS is the mean over queries, with a percentile bootstrap CI over queries.
Noise ceiling: the same subsets retrained with a second seed; Spearman between the two
seeds' measurements (what a perfect predictor of seed A's outcome scores on seed B).
"""

from __future__ import annotations

import numpy as np

from prism_jax import bootstrap


def subset_masks(num_train: int, num_subsets: int, alpha: float, seed: int) -> np.ndarray:
  """(M, E) bool: each subset keeps exactly round(α·E) training sequences at random."""
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha must be in (0, 1), got {alpha}")
  if num_subsets < 1 or num_train < 2:
    raise ValueError(f"need >= 1 subset of >= 2 sequences, got {num_subsets} of {num_train}")
  keep = int(round(alpha * num_train))
  rng = np.random.default_rng(seed)
  masks = np.zeros((num_subsets, num_train), bool)
  for m in range(num_subsets):
    masks[m, rng.choice(num_train, keep, replace=False)] = True
  return masks


def predicted_loss(scores_QxE: np.ndarray, keep_MxE: np.ndarray) -> np.ndarray:
  """(Q, M): the linear datamodel's query loss on each subset, up to a constant."""
  scores_QxE, keep_MxE = np.asarray(scores_QxE, np.float64), np.asarray(keep_MxE, bool)
  if scores_QxE.ndim != 2 or keep_MxE.ndim != 2 or scores_QxE.shape[1] != keep_MxE.shape[1]:
    raise ValueError(f"scores (Q, E) and subset masks (M, E) disagree: {scores_QxE.shape} "
                     f"vs {keep_MxE.shape}")
  return -scores_QxE @ keep_MxE.T.astype(np.float64)


def _ranks(x_QxM: np.ndarray) -> np.ndarray:
  """Ranks along the last axis, ties given their average rank (1-based)."""
  order = np.argsort(x_QxM, axis=-1, kind="stable")
  ranks = np.empty_like(x_QxM, dtype=np.float64)
  for q in range(x_QxM.shape[0]):
    xs = x_QxM[q, order[q]]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(xs)]
    avg = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    ranks[q, order[q]] = avg
  return ranks


def spearman_rows(a_QxM: np.ndarray, b_QxM: np.ndarray) -> np.ndarray:
  """(Q,) Spearman correlation of each row of a with the same row of b (NaN when a row is
  constant: no ranking to correlate)."""
  a_QxM, b_QxM = np.asarray(a_QxM, np.float64), np.asarray(b_QxM, np.float64)
  if a_QxM.shape != b_QxM.shape or a_QxM.ndim != 2:
    raise ValueError(f"spearman_rows needs two (Q, M) arrays of one shape, got "
                     f"{a_QxM.shape} and {b_QxM.shape}")
  if a_QxM.shape[1] < 3:
    raise ValueError(f"a Spearman correlation needs >= 3 subsets, got {a_QxM.shape[1]}")
  ra, rb = _ranks(a_QxM), _ranks(b_QxM)
  ra -= ra.mean(1, keepdims=True)
  rb -= rb.mean(1, keepdims=True)
  den = np.sqrt((ra ** 2).sum(1) * (rb ** 2).sum(1))
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(den > 0, (ra * rb).sum(1) / np.where(den > 0, den, 1.0), np.nan)


def lds_per_query(scores_QxE: np.ndarray, keep_MxE: np.ndarray,
                  measured_QxM: np.ndarray) -> np.ndarray:
  """(Q,) LDS of each query (see the module doc for the sign)."""
  pred = predicted_loss(scores_QxE, keep_MxE)
  if np.asarray(measured_QxM).shape != pred.shape:
    raise ValueError(f"measured losses must be (Q, M) = {pred.shape}, got "
                     f"{np.asarray(measured_QxM).shape}")
  return spearman_rows(pred, measured_QxM)


def bootstrap_ci(values_Q: np.ndarray, *, num_samples: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
  """(mean, lo, hi): the mean over queries (NaNs dropped) and its percentile bootstrap CI."""
  v = np.asarray(values_Q, np.float64)
  v = v[np.isfinite(v)]
  if len(v) == 0:
    raise ValueError("no finite value to average (every query's correlation is undefined)")
  return bootstrap.mean_ci(v, bootstrap.bootstrap_index(len(v), num_samples, seed), level)


def noise_ceiling(measured_a_QxM: np.ndarray, measured_b_QxM: np.ndarray) -> np.ndarray:
  """(Q,) Spearman across subsets between two seeds' measurements of the same subsets."""
  return spearman_rows(measured_a_QxM, measured_b_QxM)


def removal_keep(scores_E: np.ndarray, m: int) -> np.ndarray:
  """(E,) bool keep mask without the query's m most helpful sequences (highest scores;
  ties broken by the lower id). With a random method's scores: m random sequences."""
  scores_E = np.asarray(scores_E, np.float64)
  if scores_E.ndim != 1 or not 0 <= m < len(scores_E):
    raise ValueError(f"cannot remove m={m} of {scores_E.shape} training sequences")
  keep = np.ones(len(scores_E), bool)
  keep[np.argsort(-scores_E, kind="stable")[:m]] = False
  return keep


def query_halves(num_queries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(choose, report): the query indices split at random in two (seeded; the report half
  takes the odd one), each sorted. Choices (which groups, projection, damping) are made on
  the first and measured once on the second."""
  if num_queries < 2:
    raise ValueError(f"splitting queries in halves needs >= 2 queries, got {num_queries}")
  perm = np.random.default_rng([seed, 55]).permutation(num_queries)
  half = num_queries // 2
  return np.sort(perm[:half]), np.sort(perm[half:])


def choose_best(lds_by_method: dict[str, np.ndarray], among: list[str],
                choose_Q: np.ndarray) -> tuple[str, dict[str, float]]:
  """(the method of `among` with the highest mean LDS over the `choose_Q` queries, every
  candidate's mean there); ties go to the first listed, NaN queries are dropped."""
  missing = [m for m in among if m not in lds_by_method]
  if not among or missing:
    raise ValueError(f"choose among {among}: no LDS for {missing or 'an empty list'}")
  means = {m: float(np.nanmean(np.asarray(lds_by_method[m])[choose_Q])) for m in among}
  return max(among, key=lambda m: (means[m], -among.index(m))), means
