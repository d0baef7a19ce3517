"""Paired bootstrap over items: accuracy CIs and CIs of differences on the same items."""

from __future__ import annotations

import numpy as np


def bootstrap_index(n: int, resamples: int = 2000, seed: int = 0) -> np.ndarray:
  """(resamples, n) item indices drawn with replacement: one draw shared by every system
  compared, which makes the CIs paired."""
  if n < 1:
    raise ValueError("bootstrap needs at least one item")
  return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_ci(stat_R: np.ndarray, level: float = 0.95) -> tuple[float, float]:
  """(low, high): the central `level` interval of a statistic's bootstrap replicates."""
  if not 0.0 < level < 1.0:
    raise ValueError(f"level must be in (0, 1), got {level}")
  lo, hi = np.quantile(stat_R, [(1 - level) / 2, (1 + level) / 2])
  return float(lo), float(hi)


def mean_ci(correct_n: np.ndarray, index_RxN: np.ndarray, level: float = 0.95
            ) -> tuple[float, float, float]:
  """(mean, low, high): percentile bootstrap CI of the mean of per-item values."""
  correct_n = np.asarray(correct_n, np.float64)
  return (float(correct_n.mean()), *percentile_ci(correct_n[index_RxN].mean(1), level))


def paired_diff_ci(a_n: np.ndarray, b_n: np.ndarray, index_RxN: np.ndarray,
                   level: float = 0.95) -> tuple[float, float, float]:
  """mean(b - a) and its paired bootstrap CI (both on the same resampled items)."""
  a_n, b_n = np.asarray(a_n, np.float64), np.asarray(b_n, np.float64)
  if a_n.shape != b_n.shape:
    raise ValueError(f"paired systems need the same items: {a_n.shape} vs {b_n.shape}")
  return mean_ci(b_n - a_n, index_RxN, level)


def fmt(mean: float, lo: float, hi: float, scale: float = 100.0) -> str:
  return f"{scale * mean:.1f} [{scale * lo:.1f}, {scale * hi:.1f}]"
