"""Sparse controllers: option scores under given weights vs float64 NumPy (gains: the edited
logits' log-softmax; linear: base + features · w), agreement with the shared gains edit,
a fit that finds a planted prototype, exact sparsity from the L1 step, and refusal of a
controller on another model."""

import functools
import secrets

import jax.numpy as jnp
import numpy as np
import pytest

from prism_jax.attribution.caching.cache_format import model_fingerprint
from prism_jax.config import model_preset
from prism_jax.control import controllers as ctl
from prism_jax.data.tokenizers import ByteTokenizer
from prism_jax.evaluation import scoring
from prism_jax.evaluation.tasks import shared_context
from prism_jax.model.lm import build_model
from prism_jax.model.logit_edit import controlled_logits

K = 16
SEEDS = {}


@functools.cache
def _model(tag="a"):
  seed = SEEDS[tag] = secrets.randbits(16)
  cfg = model_preset("tiny", vocab_size=258, max_len=32, d_model=32, n_layers=1, n_heads=2,
                     num_prototypes=K, k=4, init_std=0.3)
  return build_model(cfg, seed=seed)


@functools.cache
def _data():
  rng = np.random.default_rng(secrets.randbits(16))
  words = ["ab", "cd", "efg", "h", "ijk"]
  text = lambda n: " ".join(rng.choice(words, n))
  items = [shared_context("t", i, text(3), [text(1), text(2), text(2)], int(rng.integers(3)))
           for i in range(6)]
  enc = scoring.encode_items(items, ByteTokenizer(), 32)
  return items, enc, ctl.code_data(items, scoring.score_options(_model(), enc, batch_rows=4,
                                                                collect=True))


def _w(rng):
  w = rng.standard_normal(K).astype(np.float32)
  w[rng.random(K) < 0.5] = 0.0
  return w


def test_gains_scores_match_float64_and_the_shared_edit():
  model, (_, enc, data) = _model(), _data()
  rng = np.random.default_rng(secrets.randbits(16))
  w = _w(rng)
  fp = model_fingerprint(model)
  got = ctl.controlled_scores(ctl.SparseController("gains", "prism", w, fp, 0.0), model,
                              model.bank.protos[...], data, fp)
  p = np.asarray(model.bank.protos[...], np.float64)
  wte = np.asarray(model.backbone.wte[...], np.float64)
  delta = np.einsum("nk,nkd->nd", w[data.idx_Cxk] * data.coef_Cxk, p[data.idx_Cxk]) @ wte.T
  logits = np.float64(data.logits_CxV) + delta
  lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
  logp = logits[np.arange(len(logits)), data.targets_C] - lse
  want = np.bincount(data.option_C, logp, minlength=len(data.logprob_O))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=f"seeds {SEEDS}")
  # the same edit through controlled_logits (gains 1 + w) on option 0's full window
  out = model(jnp.asarray(enc.inputs[0][None]))
  edited = np.asarray(controlled_logits(model, out, jnp.asarray(1.0 + w)))[0]
  n = enc.num_cont_O[0]
  np.testing.assert_allclose(edited[-n:], logits[data.option_C == 0], rtol=1e-4, atol=1e-4)


def test_linear_scores_match_float64():
  model, (_, _, data) = _model(), _data()
  rng = np.random.default_rng(secrets.randbits(16))
  w = _w(rng)
  fp = model_fingerprint(model)
  got = ctl.controlled_scores(ctl.SparseController("linear", "prism", w, fp, 0.0), model,
                              model.bank.protos[...], data, fp)
  feat = np.zeros((len(data.logprob_O), K))
  for c in range(len(data.option_C)):
    for j in range(data.idx_Cxk.shape[1]):
      feat[data.option_C[c], data.idx_Cxk[c, j]] += data.coef_Cxk[c, j]
  np.testing.assert_allclose(got, data.logprob_O + feat @ w, rtol=1e-5, atol=1e-5)


def _planted(rng, n_items=300, opts=4, toks=3, k=2, planted=5):
  """Codes drawn at random; the gold option is the one whose code uses `planted` most."""
  n_opt = n_items * opts
  idx = rng.integers(0, K, (n_opt * toks, k))
  coef = rng.uniform(0, 1, (n_opt * toks, k)).astype(np.float32)
  option = np.repeat(np.arange(n_opt), toks)
  base = 0.3 * rng.standard_normal(n_opt)
  use = np.bincount(option, np.where(idx == planted, coef, 0).sum(1), minlength=n_opt)
  gold = (base + 3.0 * use).reshape(n_items, opts).argmax(1)
  items = [shared_context("p", i, "c", ["a"] * opts, int(gold[i])) for i in range(n_items)]
  v = 8
  return ctl.CodeData(items, base, option, np.zeros((len(option), v), np.float32),
                      np.zeros(len(option), np.int32), idx, coef)


def test_linear_fit_finds_the_planted_prototype_and_helps_held_out():
  rng = np.random.default_rng(secrets.randbits(16))
  data = _planted(rng)
  cal, held = ctl.calibration_split(len(data.items), 0.5, seed=0)
  dict_KxD = jnp.zeros((K, 4))
  c = ctl.select_and_fit("linear", "prism", None, dict_KxD, data.subset(cal), "fp",
                         lams=(1e-3, 1e-2), steps=150, lr=0.1)
  assert c.nonzero()[0][0] == 5 and c.w_K[5] > 0
  held_data = data.subset(held)
  before = scoring.correct(held_data.items, held_data.logprob_O).mean()
  after = scoring.correct(held_data.items,
                          ctl.controlled_scores(c, None, dict_KxD, held_data, "fp")).mean()
  assert after > before + 0.15, (before, after)
  sparse = ctl.fit_controller("linear", "prism", None, dict_KxD, data.subset(cal), "fp",
                              lam=10.0, steps=50, lr=0.1)
  assert not sparse.nonzero(), "a huge L1 weight must zero every weight exactly"


def test_controller_on_another_model_is_refused(tmp_path):
  model, other, (_, _, data) = _model("a"), _model("b"), _data()
  fp = model_fingerprint(model)
  c = ctl.SparseController("gains", "prism", np.zeros(K, np.float32), fp, 0.01)
  c.save(str(tmp_path / "c.json"))
  loaded = ctl.SparseController.load(str(tmp_path / "c.json"))
  assert loaded.fingerprint == fp and loaded.kind == "gains"
  with pytest.raises(ctl.ControllerMismatchError, match="was fit on model"):
    ctl.controlled_scores(loaded, other, other.bank.protos[...], data, model_fingerprint(other))


def test_bad_inputs():
  with pytest.raises(ValueError, match="unknown controller kind"):
    ctl.SparseController("quadratic", "prism", np.zeros(2), "fp", 0.0)
  with pytest.raises(ValueError, match="fraction must be in"):
    ctl.calibration_split(10, 1.0)
  a, b = ctl.calibration_split(10, 0.5, seed=3)
  assert not set(a) & set(b) and len(a) + len(b) == 10
  np.testing.assert_array_equal(a, ctl.calibration_split(10, 0.5, seed=3)[0])
