"""Bootstrap CIs of per-generation behaviour scores, on prism_jax.bootstrap' one resampler."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from prism_jax import bootstrap


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
  return Estimate(*bootstrap.mean_ci(x, bootstrap.bootstrap_index(x.size, num_resamples,
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
  pick = bootstrap.bootstrap_index(b.size, num_resamples, seed)
  ratios = 1.0 - a[pick].mean(1) / np.maximum(b[pick].mean(1), 1e-12)
  return Estimate(float(1.0 - a.mean() / b.mean()), *bootstrap.percentile_ci(ratios, level))


def _per_prompt(values, num_prompts: int) -> np.ndarray:
  """(P,) per-prompt means of prompt-major generation scores (P prompts × S samples)."""
  x = np.asarray(values, np.float64).reshape(-1)
  if num_prompts < 2 or x.size % num_prompts:
    raise ValueError(f"{x.size} scores do not split into {num_prompts} >= 2 equal prompts")
  return x.reshape(num_prompts, -1).mean(1)


def clustered_mean(values, num_prompts: int, *, num_resamples: int = 2000,
                   level: float = 0.95, seed: int = 0) -> Estimate:
  """Mean of prompt-major scores, CI by resampling prompts (the generations of one prompt
  are not independent: the prompt is the unit)."""
  p = _per_prompt(values, num_prompts)
  return Estimate(*bootstrap.mean_ci(p, bootstrap.bootstrap_index(p.size, num_resamples,
                                                                     seed), level))


def clustered_fall(before, after, num_prompts: int, *, num_resamples: int = 2000,
                   level: float = 0.95, seed: int = 0) -> Estimate:
  """1 − mean(after)/mean(before) over the same prompts, CI by resampling prompts (paired)."""
  b, a = _per_prompt(before, num_prompts), _per_prompt(after, num_prompts)
  if b.mean() <= 0:
    raise ValueError("the behaviour never occurs before the edit: no rate to reduce")
  pick = bootstrap.bootstrap_index(b.size, num_resamples, seed)
  ratios = 1.0 - a[pick].mean(1) / np.maximum(b[pick].mean(1), 1e-12)
  return Estimate(float(1.0 - a.mean() / b.mean()), *bootstrap.percentile_ci(ratios, level))
