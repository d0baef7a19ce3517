"""Synthetic tasks from held-out documents (the gold option is the document's true text,
distractors come from elsewhere; seeded) and the paired bootstrap vs a brute-force loop."""

import secrets

import numpy as np
import pytest

from prism_jax.data.tokenizers import ByteTokenizer
from prism_jax import bootstrap
from prism_jax.evaluation import synthetic


class FakePacked:
  """The slice of data.packed.PackedData the builders read."""

  def __init__(self, texts):
    self.tokenizer = ByteTokenizer()
    self.docs = [np.asarray(self.tokenizer.encode(t)) for t in texts]

  def document_ids(self, split):
    return np.arange(len(self.docs)) if split == "val" else np.zeros(0, int)

  def document_tokens(self, i):
    return self.docs[i]


def _texts(rng, n=6):
  words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
  return [" ".join(rng.choice(words, 40)) + f" doc{i}" for i in range(n)]


def test_next_span_gold_is_the_true_continuation():
  rng = np.random.default_rng(secrets.randbits(16))
  texts = _texts(rng)
  items = synthetic.next_span_items(FakePacked(texts), 30, ctx_tokens=20, span_tokens=6, seed=4)
  for it in items:
    true = it.contexts[0] + it.continuations[it.gold]
    assert any(true in t for t in texts)
    assert len(set(it.contexts)) == 1 and it.num_options == 4
  again = synthetic.next_span_items(FakePacked(texts), 30, ctx_tokens=20, span_tokens=6, seed=4)
  assert again == items
  assert len({it.gold for it in items}) > 1  # gold positions are shuffled


def test_cloze_gold_is_the_true_word():
  rng = np.random.default_rng(secrets.randbits(16))
  texts = _texts(rng)
  for it in synthetic.cloze_items(FakePacked(texts), 20, seed=1):
    assert any(it.contexts[0] + it.continuations[it.gold] in t for t in texts)
    assert len({c.lower() for c in it.continuations}) == 4


def test_synthetic_bad_input():
  with pytest.raises(ValueError, match="unknown synthetic task"):
    synthetic.synthetic_items("synthetic_rhyme", FakePacked(["a b c"]), 3)
  with pytest.raises(ValueError, match="no val documents"):
    synthetic.next_span_items(FakePacked([]), 3)


def test_paired_bootstrap_matches_a_loop():
  rng = np.random.default_rng(secrets.randbits(16))
  a = (rng.random(50) < 0.5).astype(float)
  b = np.where(rng.random(50) < 0.8, a, 1 - a)
  index = bootstrap.bootstrap_index(50, 500, seed=2)
  diffs = sorted(np.mean(b[r]) - np.mean(a[r]) for r in index)
  mean, lo, hi = bootstrap.paired_diff_ci(a, b, index)
  assert mean == pytest.approx(b.mean() - a.mean())
  assert lo == pytest.approx(np.quantile(diffs, 0.025)) and hi == pytest.approx(
      np.quantile(diffs, 0.975))
  m, lo, hi = bootstrap.mean_ci(a, index)
  assert lo <= m <= hi and m == pytest.approx(a.mean())
  with pytest.raises(ValueError, match="same items"):
    bootstrap.paired_diff_ci(a, b[:10], index)
  for level in (0.0, 1.0, 95):
    with pytest.raises(ValueError, match="level must be in"):
      bootstrap.mean_ci(a, index, level)
