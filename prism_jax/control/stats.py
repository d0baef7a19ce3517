"""Percentile bootstrap confidence intervals for per-generation behaviour scores."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


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
  if not 0.0 < level < 1.0:
    raise ValueError(f"level must be in (0, 1), got {level}")
  rng = np.random.default_rng(seed)
  means = x[rng.integers(0, x.size, size=(num_resamples, x.size))].mean(1)
  tail = 50.0 * (1.0 - level)
  return Estimate(float(x.mean()), float(np.percentile(means, tail)),
                  float(np.percentile(means, 100.0 - tail)))


def bootstrap_ratio_change(before, after, *, num_resamples: int = 2000, level: float = 0.95,
                           seed: int = 0) -> Estimate:
  """Relative change 1 − mean(after)/mean(before) with a paired bootstrap CI (the same
  resampled generations: prompts and seeds are shared by the two conditions)."""
  b, a = np.asarray(before, np.float64), np.asarray(after, np.float64)
  if b.shape != a.shape or b.size == 0:
    raise ValueError(f"paired samples must have one equal, non-empty shape: {b.shape} {a.shape}")
  if b.mean() <= 0:
    raise ValueError("the behaviour never occurs before the edit: no rate to reduce")
  rng = np.random.default_rng(seed)
  pick = rng.integers(0, b.size, size=(num_resamples, b.size))
  ratios = 1.0 - a[pick].mean(1) / np.maximum(b[pick].mean(1), 1e-12)
  tail = 50.0 * (1.0 - level)
  return Estimate(float(1.0 - a.mean() / b.mean()), float(np.percentile(ratios, tail)),
                  float(np.percentile(ratios, 100.0 - tail)))
