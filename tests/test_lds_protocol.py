"""The LDS protocol (prism_jax/attribution/quality/protocol.py) on a synthetic retrain: each
retrain's loss is a known function of the rows it keeps and its seed, so every number the
protocol reports is recomputed here directly (NumPy, scipy's Spearman)."""

import secrets

import numpy as np
import pytest
from scipy import stats

from prism_jax.attribution.quality import protocol

Q, E = 6, 40


class _SyntheticRetrains:
  """run(name, keep_E, seed): loss_q = base_q + Σ_kept effect_qe + seed noise; records every
  call."""

  def __init__(self, rng):
    self.effect_QxE = rng.normal(size=(Q, E))
    self.base_Q = rng.normal(size=Q)
    self.noise = {s: rng.normal(scale=0.3, size=(Q, 10_000)) for s in (0, 1)}
    self.calls = []

  def loss(self, keep_E, seed, call):
    return self.base_Q + self.effect_QxE @ keep_E + self.noise[seed][:, call]

  def __call__(self, name, keep_E, seed):
    keep_E = np.asarray(keep_E, bool)
    self.calls.append((name, keep_E.copy(), seed))
    return self.loss(keep_E.astype(np.float64), seed, len(self.calls) - 1)


def test_measure_runs_the_protocols_retrains_and_its_numbers_hold():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  p = protocol.Protocol(num_rows=E, subsets=8, alpha=0.5, ceiling_subsets=4,
                        removal_queries=2, removal_m=(3, 7), seed=int(rng.integers(1000)))
  run = _SyntheticRetrains(rng)
  scores = {"good": -run.effect_QxE + rng.normal(scale=0.05, size=(Q, E)),
            "noise": rng.normal(size=(Q, E))}
  got = protocol.measure(run, p, scores, removal_methods=["good"])
  names = [c[0] for c in run.calls]
  assert len(names) == p.num_retrains(["good"]) == 2 + 8 + 4 + 2 * 1 * 2, f"seed {seed}"
  assert names[:2] == ["full_s0", "full_s1"]
  assert names[2:10] == [f"lds{m}_s0" for m in range(8)]
  assert names[10:14] == [f"lds{m}_s1" for m in range(4)]
  assert [c[2] for c in run.calls[10:14]] == [1] * 4  # the ceiling's second seed
  keep = got.keep
  assert keep.shape == (8, E) and np.all(keep.sum(1) == E // 2)
  for m in range(4):  # the ceiling retrains the same subsets
    np.testing.assert_array_equal(run.calls[10 + m][1], keep[m])
  # each query's LDS: Spearman of −Σ kept scores against the measured losses (scipy)
  meas = np.stack([run.loss(keep[m].astype(float), 0, 2 + m) for m in range(8)], 1)
  np.testing.assert_allclose(got.meas, meas, rtol=1e-12)
  for name, s in scores.items():
    want = [stats.spearmanr(-(s[q] * keep).sum(1), meas[q]).statistic for q in range(Q)]
    np.testing.assert_allclose(got.per_query[name], want, rtol=1e-9, atol=1e-12)
  assert got.per_query["good"].mean() > 0.5  # scores that track the effects predict well
  # removal: the top-m rows by score dropped, the loss change against the full model
  for j, m in enumerate(p.removal_m):
    for q in range(2):
      name, kept, s = next(c for c in run.calls if c[0] == f"rm_good_q{q}_m{m}")
      top = np.argsort(-scores["good"][q], kind="stable")[:m]
      assert s == 0 and not kept[top].any() and kept.sum() == E - m
      call = names.index(name)
      want = run.loss(kept.astype(float), 0, call)[q] - got.full0[q]
      assert got.deltas["good"][q, j] == pytest.approx(want, rel=1e-12)
  # the ceiling: the two seeds' Spearman on the shared subsets, mean over queries
  meas_b = np.stack([run.loss(keep[m].astype(float), 1, 10 + m) for m in range(4)], 1)
  rho = [stats.spearmanr(meas[q, :4], meas_b[q]).statistic for q in range(Q)]
  assert got.ceiling[0] == pytest.approx(np.mean(rho), rel=1e-9)
  assert got.ceiling[1] <= got.ceiling[0] <= got.ceiling[2]


def test_no_ceiling_and_no_removal():
  rng = np.random.default_rng(secrets.randbits(32))
  p = protocol.Protocol(num_rows=E, subsets=3, alpha=0.25, ceiling_subsets=0,
                        removal_queries=0, removal_m=(5,), seed=0)
  run = _SyntheticRetrains(rng)
  got = protocol.measure(run, p, {"a": rng.normal(size=(Q, E))}, removal_methods=["a"])
  assert got.ceiling is None and got.deltas["a"].shape == (0, 1)
  assert [c[0] for c in run.calls] == ["full_s0", "full_s1", "lds0_s0", "lds1_s0", "lds2_s0"]
  assert p.num_retrains(["a"]) == 5
