"""Bootstrap CIs of per-generation behaviour scores, on prism_jax.stats' one resampler."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prism_jax import stats as eval_stats


class Estimate(NamedTuple):
  mean: float
  lo: float
  hi: float


def bootstrap_mean(values, *, num_resamples: int = 2000, level: float = 0.95,
                   seed: int = 0) -> Estimate:
  """The mean of `values` and its percentile-bootstrap CI at `level`."""
  x = np.asarray(values, np.float64).reshape(-1)
  if x.size == 0:
    raise ValueError("bootstrap of an empty sample")
  return Estimate(*eval_stats.mean_ci(x, eval_stats.bootstrap_index(x.size, num_resamples,
                                                                     seed), level))


def bootstrap_ratio_change(before, after, *, num_resamples: int = 2000, level: float = 0.95,
                           seed: int = 0) -> Estimate:
  """Relative change 1 − mean(after)/mean(before) with a paired bootstrap CI (the same
  resampled generations: prompts and seeds are shared by the two conditions)."""
  b, a = np.asarray(before, np.float64), np.asarray(after, np.float64)
  if b.shape != a.shape or b.size == 0:
    raise ValueError(f"paired samples must have one equal, non-empty shape: {b.shape} {a.shape}")
  if b.mean() <= 0:
    raise ValueError("the behaviour never occurs before the edit: no rate to reduce")
  pick = eval_stats.bootstrap_index(b.size, num_resamples, seed)
  ratios = 1.0 - a[pick].mean(1) / np.maximum(b[pick].mean(1), 1e-12)
  return Estimate(float(1.0 - a.mean() / b.mean()), *eval_stats.percentile_ci(ratios, level))
