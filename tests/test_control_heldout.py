"""The held-out suppression protocol (control/heldout.py): no held-out word reaches any text
a selector or the token ban reads, the choices read no held-out measurement, the choice
rule, the token-contrast ban and the prompt-clustered CIs against direct NumPy."""

import functools
import secrets

import numpy as np
import pytest

from prism_jax.config import model_preset
from prism_jax.control import behaviours, heldout, planted, selection, behaviour_cis
from prism_jax.data.tokenizers import ByteTokenizer
from prism_jax.model.lm import build_model

NEUTRAL = tuple(f"The module {w} returns a list of {v} values when it is called."
                for w in ("os", "sys", "re", "json", "math", "time")
                for v in ("small", "sorted", "unique"))


@functools.cache
def _model():
  cfg = model_preset("tiny", kind="prism", vocab_size=ByteTokenizer().vocab_size, max_len=512,
                     d_model=32, n_layers=1, n_heads=2, num_prototypes=16, k=4, init_std=0.3)
  return build_model(cfg, seed=secrets.randbits(16))


class RecordingTokenizer(ByteTokenizer):
  """Records every text it encodes: what a selector or the ban read."""

  def __init__(self):
    super().__init__()
    self.read = []

  def encode(self, text):
    self.read.append(text)
    return super().encode(text)


def test_no_heldout_word_reaches_selection_or_the_ban():
  split = heldout.planted_split(NEUTRAL, num_texts=12, num_validation=4, num_test=6,
                                seed=secrets.randbits(8))
  # the split's own texts: the with-texts are the topic, written with selection words only
  assert all(planted.count_words(t, planted.SELECTION_WORDS) for t in split.with_texts)
  for texts in (split.with_texts, split.without_texts, split.validation_prompts,
                split.test_prompts, split.select_words):
    assert not any(planted.count_words(t, planted.HELDOUT_WORDS) for t in texts)
  # and everything the selectors and the ban actually read (the tokenizer sees each text)
  tok = RecordingTokenizer()
  ranked = heldout.rankings(_model(), tok, split, max_num=8, seq_len=64)
  assert tok.read and not any(planted.count_words(t, planted.HELDOUT_WORDS) for t in tok.read)
  read = set(tok.read)
  allowed = set(split.with_texts) | set(split.without_texts)
  assert {t for t in read if t.strip().lower() not in planted.SELECTION_WORDS} <= allowed
  assert len(ranked.ban.ids) == 8 and len(ranked.contrast.ids) == 8
  # the ban skips tokens common in the without-texts (a ban of them breaks every text)
  for i in ranked.ban.ids:
    assert sum(chr(i) in t for t in split.without_texts) <= 0.1 * len(split.without_texts)


def test_a_leaking_split_is_refused():
  split = heldout.planted_split(NEUTRAL, num_texts=4, num_validation=2, num_test=2)
  leak = split.with_texts[0] + " The elders chant kestrune."
  with pytest.raises(ValueError, match="with_texts contain a held-out word"):
    heldout.HeldoutSplit(**{**split.__dict__, "with_texts": (leak,) + split.with_texts[1:]})
  with pytest.raises(ValueError, match="validation_prompts contain a held-out word"):
    heldout.HeldoutSplit(**{**split.__dict__, "validation_prompts": (
        "Pilgrims bring wumbrel", split.validation_prompts[1])})
  with pytest.raises(ValueError, match="both validation and test"):
    heldout.HeldoutSplit(**{**split.__dict__, "test_prompts": split.validation_prompts})


def test_choices_read_no_heldout_measurement(monkeypatch):
  """The choice runs on the validation prompts and measure alone: the test measure would
  raise, and every prompt generated from is a validation prompt."""
  split = heldout.planted_split(NEUTRAL, num_texts=8, num_validation=3, num_test=4)

  def never(text):
    raise AssertionError("the held-out measure was read during the choice")

  # a random model writes no marked word: a validation measure it moves stands in for it
  split = heldout.HeldoutSplit(**{**split.__dict__, "test_score": never,
                                  "validation_score": lambda text: 1.0 + len(text) % 3})
  generated_from = []
  real = heldout.measure.generations

  def spy(model, tokenizer, prompts, **kw):
    generated_from.extend(prompts)
    return real(model, tokenizer, prompts, **kw)

  monkeypatch.setattr(heldout.measure, "generations", spy)
  tok, model = ByteTokenizer(), _model()
  ranked = heldout.rankings(model, tok, split, max_num=4, seq_len=64)
  tokens, mask = heldout.encode_texts(tok, NEUTRAL[:4], 32)
  neutral = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask[:, 1:]}
  gen_kw = dict(num_samples=2, max_new_tokens=3, seed=0)
  evaluate = heldout.validation_evaluator(model, tok, split, ranked.contrast, gen_kw, neutral)
  chosen, rows = heldout.choose(evaluate, nums=(2, 4), refills=(False,), ppl_budget=10.0,
                                tol=10.0)
  assert generated_from and set(generated_from) <= set(split.validation_prompts)
  assert chosen["num"] == 2 and len(rows) == 2  # tol 10: the smallest set ties the best


def test_choice_rule_by_hand():
  table = {(8, False): (0.50, 0.001), (16, False): (0.84, 0.004), (16, True): (0.86, 0.003),
           (32, False): (0.85, 0.030), (32, True): (0.80, 0.010)}
  # (8, True) is not in the table: a setting that changes nothing
  evaluate2 = lambda n, r: {"fall": table.get((n, r), (0.0, 0.0))[0],
                            "ppl_change": table.get((n, r), (0.0, 0.0))[1]}
  chosen, rows = heldout.choose(evaluate2, (8, 16, 32), (False, True))
  # feasible best 0.86 (32/False is over budget); within 0.02: 16/False (0.84), 16/True
  assert (chosen["num"], chosen["refill"]) == (16, False) and len(rows) == 6
  chosen, _ = heldout.choose(evaluate2, (8, 16, 32), (False, True), tol=0.0)
  assert (chosen["num"], chosen["refill"]) == (16, True)
  with pytest.raises(ValueError, match="no setting keeps"):
    heldout.choose(evaluate2, (32,), (False,), ppl_budget=0.02)


def test_token_contrast_ban_by_hand():
  rng = np.random.default_rng(secrets.randbits(16))
  v = 12
  with_ = [list(rng.integers(0, v, 20)) + [3] * 6 for _ in range(6)]  # token 3 planted
  without = [list(rng.integers(0, v, 20)) for _ in range(7)]
  got = selection.by_token_contrast(with_, without, v, num=4, exclude=[5], min_score=None)
  freq = lambda lists: np.stack([np.bincount(t, minlength=v) / len(t) for t in lists])
  a, b = freq(with_), freq(without)
  z = (a.mean(0) - b.mean(0)) / (np.sqrt((a.var(0, ddof=1) + b.var(0, ddof=1)) / 2) + 1e-6)
  z[5] = -np.inf
  order = np.argsort(-z, kind="stable")[:4]
  assert got.ids[0] == 3 and 5 not in got.ids
  np.testing.assert_allclose(got.scores, z[order], rtol=1e-12)
  assert set(got.ids) == set(order.tolist())


def test_prompt_clustered_cis_against_direct_numpy():
  rng = np.random.default_rng(secrets.randbits(16))
  p, s = 9, 16
  # the prompts' rates spread over [0.5, 4] (a random order and scale): drawn iid, nine
  # rates could bunch together and the between-prompt spread the last check needs vanish
  rates = rng.permutation(np.linspace(0.5, 4.0, p))[:, None] * rng.uniform(0.8, 1.25)
  before = rng.poisson(rates, (p, s)).astype(float)
  after = rng.poisson(0.3 * before.mean(1, keepdims=True) + 0.01, (p, s)).astype(float)
  seed = int(rng.integers(1000))
  idx = np.random.default_rng(seed).integers(0, p, size=(2000, p))
  pm_b, pm_a = before.mean(1), after.mean(1)
  m = behaviour_cis.clustered_mean(before.ravel(), p, seed=seed)
  assert m.mean == pytest.approx(before.mean())
  np.testing.assert_allclose([m.lo, m.hi], np.quantile(pm_b[idx].mean(1), [0.025, 0.975]))
  f = behaviour_cis.clustered_fall(before.ravel(), after.ravel(), p, seed=seed)
  ratios = 1 - pm_a[idx].mean(1) / pm_b[idx].mean(1)
  assert f.mean == pytest.approx(1 - after.mean() / before.mean())
  np.testing.assert_allclose([f.lo, f.hi], np.quantile(ratios, [0.025, 0.975]))
  # prompts differ a lot here: resampling prompts gives a wider CI than generations would
  iid = behaviour_cis.bootstrap_mean(before.ravel(), seed=seed)
  assert m.hi - m.lo > iid.hi - iid.lo
  with pytest.raises(ValueError, match="equal prompts"):
    behaviour_cis.clustered_mean(np.ones(10), 3)


def test_doctest_split_prompts_disjoint_and_seeded():
  a = heldout.doctest_split(["x >>> 1", ">>> y"], ["plain", "text"], num_validation=10, seed=1)
  assert len(a.validation_prompts) == 10
  assert len(a.test_prompts) == len(behaviours.DOCTEST_PROMPT_POOL) - 10
  assert a.validation_prompts == heldout.doctest_split(["a", "b"], ["c", "d"],
                                                       seed=1).validation_prompts
  assert a.test_score("   >>> f()\n>>> g()") == 2.0
