"""Selection of a behaviour's prototypes on synthetic banks with planted prototypes, the L1
probe against its optimality (KKT) conditions in float64, and the behaviour scorers."""

import functools
import importlib.util
import secrets

import numpy as np
import pytest

from prism_jax.analysis.cards import Card, CardSet, Context
from prism_jax.config import model_preset
from prism_jax.control import behaviours, planted, selection, behaviour_cis
from prism_jax.model.lm import build_model

VOCAB, K, D = 64, 32, 16


@functools.cache
def _model():
  cfg = model_preset("tiny", vocab_size=VOCAB, max_len=8, d_model=D, n_layers=1, n_heads=2,
                     num_prototypes=K, k=4, init_std=0.3)
  return build_model(cfg, seed=secrets.randbits(16))


def test_logit_signature_finds_planted_prototypes():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  model = _model()
  targets = rng.choice(VOCAB, size=3, replace=False)
  planted_ids = rng.choice(K, size=4, replace=False)
  wte = np.asarray(model.backbone.wte[...], np.float64)
  bank = rng.normal(size=(K, D)) * 0.3
  # a planted shift well above the random rows' spread (2.0 let a random row outscore a
  # planted one now and then: {9, 10, 22, 30} for {9, 10, 22, 31} in one CI run)
  bank[planted_ids] += 4.0 * wte[targets].sum(0) / np.linalg.norm(wte[targets].sum(0))
  model.bank.protos[...] = bank.astype(np.float32)
  sel = selection.by_logit_signature(model, targets, num=4)
  assert set(sel.ids) == set(planted_ids.tolist()), f"seed {seed}"
  sig = bank @ wte.T  # float64 reference of the scores
  want = ((sig - sig.mean(1, keepdims=True))[:, targets].mean(1) / sig.std(1))
  # float32 scores against float64: an absolute floor at the scores' scale (a score near 0
  # missed rtol=1e-4 alone by 3e-8 on one CI draw)
  np.testing.assert_allclose(selection.logit_signature_scores(model, targets), want, rtol=1e-4,
                             atol=1e-5 * np.abs(want).max())
  assert list(sel.scores) == sorted(sel.scores, reverse=True)


def _contrast_sets(rng, planted_ids, n=40):
  without = rng.gamma(1.0, 0.05, size=(n, K))
  with_ = rng.gamma(1.0, 0.05, size=(n, K))
  with_[:, planted_ids] += rng.uniform(0.1, 0.3, size=(n, len(planted_ids)))
  return with_, without


def test_contrast_and_probe_find_planted_prototypes():
  rng = np.random.default_rng(secrets.randbits(32))
  planted_ids = rng.choice(K, size=3, replace=False)
  with_, without = _contrast_sets(rng, planted_ids)
  assert set(selection.by_contrast(with_, without, num=3).ids) == set(planted_ids.tolist())
  probe = selection.by_probe(with_, without, l1=0.05)
  assert set(planted_ids.tolist()) <= set(probe.ids[:6])
  assert set(probe.ids) <= set(range(K)) and all(s > 0 for s in probe.scores)


def test_l1_logistic_meets_kkt_conditions():
  rng = np.random.default_rng(secrets.randbits(32))
  x = rng.normal(size=(60, 8)) * rng.uniform(0.5, 3.0, 8) + rng.normal(size=8)
  score = x[:, 0] - 0.5 * x[:, 3] + rng.normal(size=60)
  y = (score > np.median(score)).astype(float)  # both classes (a fixed 0 gave one on a shift)
  mu, sd = x.mean(0), x.std(0)
  xs = (x - mu) / sd  # the problem is solved on standardised features
  s = 2 * y - 1
  # λ_max: the smallest penalty whose solution is all zeros (|∇| at w = 0, optimal intercept).
  # Half of it zeroes the weak noise features but keeps the planted one, whatever the draw
  # (a fixed 0.03 left all 8 weights non-zero on some draws).
  l1 = 0.5 * np.abs((xs * (y - y.mean())[:, None]).mean(0)).max()
  w, b = selection.l1_logistic(x, y, l1=l1, steps=5000)
  ws = w * sd
  b_s = b + w @ mu  # intercept on the standardised scale
  np.testing.assert_allclose(xs @ ws + b_s, x @ w + b, atol=1e-9)
  margin = s * (xs @ ws + b_s)
  sigma = 1 / (1 + np.exp(margin))
  grad = -(xs * (s * sigma)[:, None]).mean(0)
  nz = np.abs(ws) > 1e-8
  assert nz.any() and (~nz).any()  # the penalty zeroes some weights, not all
  np.testing.assert_allclose(grad[nz], -l1 * np.sign(ws[nz]), atol=2e-4)
  assert (np.abs(grad[~nz]) <= l1 + 2e-4).all()
  assert abs(-(s * sigma).mean()) < 2e-4  # the free intercept is optimal too


def test_text_features_match_brute_force():
  rng = np.random.default_rng(secrets.randbits(32))
  model = _model()
  tokens = rng.integers(0, VOCAB, (3, 8))
  mask = rng.random((3, 8)) < 0.7
  mask[:, 0] = True
  got = selection.text_features(model, tokens, mask)
  protos = model(tokens, mask_BxT=mask).protos
  idx, act = np.asarray(protos.idx_Nxk).reshape(3, 8, -1), np.asarray(protos.act_Nxk).reshape(3, 8, -1)
  want = np.zeros((3, K))
  for b in range(3):
    for t in range(8):
      if mask[b, t]:
        for i, a in zip(idx[b, t], act[b, t]):
          want[b, i] += a / mask[b].sum()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _card_set(planted_ids):
  def card(i):
    texts = ("the ZORBAT rite" if i in planted_ids else "a plain line", "other words")
    contexts = tuple(Context(0, 0, j, 1.0, t.split()[0], t.split()[1], t.split()[-1], t)
                     for j, t in enumerate(texts))
    return Card(i, contexts, (), (), 0.1, {}, {}, "", (0.0, 0.0))
  return CardSet([card(i) for i in range(K)], {})


def test_keywords_on_cards():
  rng = np.random.default_rng(secrets.randbits(32))
  planted_ids = set(rng.choice(K, size=3, replace=False).tolist())
  sel = selection.by_keywords(_card_set(planted_ids), ["zorbat"])
  assert set(sel.ids) == planted_ids and sel.scores == (0.5,) * 3
  assert [c.proto_id for c in sel.cards] == list(sel.ids)
  by_trigger = selection.by_keywords(_card_set(planted_ids), ["zorbat"], where="trigger")
  assert set(by_trigger.ids) == planted_ids  # "ZORBAT" is the trigger token of those
  by_next = selection.by_keywords(_card_set(planted_ids), ["rite"], where="next")
  assert set(by_next.ids) == planted_ids  # "rite" is the token after the trigger


def test_selection_bad_input():
  model = _model()
  with pytest.raises(ValueError, match="token ids must be in"):
    selection.by_logit_signature(model, [VOCAB])
  with pytest.raises(ValueError, match="at least one token id"):
    selection.by_logit_signature(model, [])
  with pytest.raises(ValueError, match="matched no prototype"):
    selection.by_contrast(np.zeros((3, K)), np.ones((3, K)))
  with pytest.raises(ValueError, match="same K"):
    selection.by_contrast(np.zeros((3, K)), np.ones((3, K + 1)))
  with pytest.raises(ValueError, match="matched no prototype"):
    selection.by_keywords(_card_set({1}), ["absent"])
  with pytest.raises(ValueError, match="non-blank keyword"):
    selection.by_keywords(_card_set({1}), [" "])


def test_behaviour_scores_and_optional_scorers():
  b = behaviours.behaviour("planted")
  text = f"x {planted.HELDOUT_WORDS[0]} {planted.SELECTION_WORDS[1]} {planted.HELDOUT_WORDS[2]}s"
  assert b.score(text) == 1.0 and b.score_selection(text) == 1.0  # whole words only
  assert behaviours.behaviour("doctest").score("a\n  >>> x = 1\n>>> y\nz >>>") == 2.0
  for name, module in (("profanity", "profanity_check"), ("negative_sentiment", "vaderSentiment")):
    if importlib.util.find_spec(module) is None:
      with pytest.raises(ValueError, match=r"needs .*pip install 'prism_jax\[scorers\]'"):
        behaviours.behaviour(name)
    else:
      assert 0.0 <= behaviours.behaviour(name).score("a fine day") <= 1.0
  with pytest.raises(ValueError, match="unknown behaviour"):
    behaviours.behaviour("nsfw")


def test_planted_corpus(tmp_path):
  docs = planted.planted_documents(20, seed=secrets.randbits(16))
  counts = np.array([[planted.count_words(d, [w]) for w in planted.MARKED_WORDS] for d in docs])
  assert counts.sum(0).min() > 0  # every marked word occurs, both halves in the same slots
  assert not set(planted.SELECTION_WORDS) & set(planted.HELDOUT_WORDS)
  assert {w[0] for w in planted.SELECTION_WORDS}.isdisjoint({w[0] for w in planted.HELDOUT_WORDS})
  with pytest.raises(ValueError, match="neutral_docs"):
    planted.write_corpus(str(tmp_path / "c"), neutral_docs=0)


def test_bootstrap():
  rng = np.random.default_rng(secrets.randbits(32))
  x = rng.exponential(2.0, size=400)
  est = behaviour_cis.bootstrap_mean(x, seed=1)
  se = x.std(ddof=1) / np.sqrt(x.size)  # the normal approximation it should agree with
  assert est.lo < est.mean < est.hi
  np.testing.assert_allclose([est.lo, est.hi], [x.mean() - 1.96 * se, x.mean() + 1.96 * se],
                             rtol=0.05)
  fall = behaviour_cis.bootstrap_ratio_change(x, 0.2 * x, seed=1)
  np.testing.assert_allclose([fall.mean, fall.lo, fall.hi], 0.8, atol=1e-9)
  with pytest.raises(ValueError, match="never occurs"):
    behaviour_cis.bootstrap_ratio_change(np.zeros(3), np.zeros(3))
  with pytest.raises(ValueError, match="level must be in"):
    behaviour_cis.bootstrap_ratio_change(x, 0.5 * x, level=1.5)


def test_batched_text_features_equal_one_call():
  rng = np.random.default_rng(secrets.randbits(32))
  model = _model()
  tokens = rng.integers(0, VOCAB, (37, 8))
  mask = rng.random((37, 8)) < 0.8
  mask[:, 0] = True
  np.testing.assert_allclose(selection.batched_text_features(model, tokens, mask, batch=5),
                             selection.text_features(model, tokens, mask), rtol=1e-5,
                             atol=1e-7)
