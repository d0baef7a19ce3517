"""The scoring harness vs a float64 brute force: each option's window run alone through the
model at its own length, log-probabilities from a float64 log-sum-exp over the vocabulary,
the continuation tokens chosen by lm-eval's rules written out here independently."""

import functools
import secrets

import numpy as np
import pytest

from prism_jax.config import model_preset
from prism_jax.data.tokenizers import ByteTokenizer, train_bpe
from prism_jax.evaluation import scoring
from prism_jax.evaluation.tasks import Item, shared_context
from prism_jax.model.lm import build_model

MAX_LEN = 48
SEEDS = {}


@functools.cache
def _model(kind, vocab):
  seed = SEEDS[f"{kind}/{vocab}"] = secrets.randbits(16)
  cfg = model_preset("tiny", kind=kind, vocab_size=vocab, max_len=MAX_LEN, d_model=32,
                     n_layers=1, n_heads=2, num_prototypes=16, k=4, init_std=0.3)
  return build_model(cfg, seed=seed)


@functools.cache
def _bpe():
  words = "the cat sat on a mat while dogs ran far away from home and back again".split()
  rng = np.random.default_rng(0)
  return train_bpe([" ".join(rng.choice(words, 40)) for _ in range(50)], 300)


def _items(rng):
  words = ["cat", "mat", "dog", "home", "far", "x", "ran again"]
  text = lambda n: " ".join(rng.choice(words, n))
  items = [shared_context("t", 0, text(3), [text(1), text(2), text(4)], 1),
           shared_context("t", 1, text(30), [text(2), text(3)], 0),  # > max_len: truncated
           Item("t", 2, ("", text(2) + " "), (text(3), text(1)), 1),  # empty ctx; trailing ws
           shared_context("t", 3, text(8) + "\n", [text(5), text(1), text(2), text(4)], 3)]
  return items


def _reference(model, tok, item):
  """float64 log-probabilities per option, by hand."""
  w = np.asarray(model.backbone.wte[...], np.float64)
  out = []
  for ctx, cont in zip(item.contexts, item.continuations):
    stripped = ctx.rstrip()
    cont = ctx[len(stripped):] + cont
    if stripped:
      c_ids = tok.encode(stripped)
      k_ids = tok.encode(stripped + cont)[len(c_ids):]
    else:
      c_ids, k_ids = [tok.eos_id], tok.encode(cont)
    seq = (c_ids + k_ids)[-(MAX_LEN + 1):]
    z = np.asarray(model(np.asarray([seq[:-1]], np.int32)).z_BxTxD[0], np.float64)
    logits = z @ w.T
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    logp = logits[np.arange(len(seq) - 1), seq[1:]] - lse
    out.append(logp[-len(k_ids):].sum())
  return np.asarray(out)


@pytest.mark.parametrize("kind,tok_name", [("dense", "byte"), ("prism", "bpe")])
def test_option_logprobs_equal_float64_brute_force(kind, tok_name):
  tok = ByteTokenizer() if tok_name == "byte" else _bpe()
  model = _model(kind, tok.vocab_size)
  rng = np.random.default_rng(secrets.randbits(16))
  items = _items(rng)
  enc = scoring.encode_items(items, tok, MAX_LEN)
  assert enc.truncated_O.any(), "the long context must exercise left truncation"
  scores = scoring.score_options(model, enc, batch_rows=3, collect=True)
  want = np.concatenate([_reference(model, tok, it) for it in items])
  np.testing.assert_allclose(scores.logprob_O, want, rtol=2e-5, atol=2e-4,
                             err_msg=f"seeds {SEEDS}")
  # the collected rows are the continuation tokens, in option order
  assert len(scores.targets_C) == enc.num_cont_O.sum()
  assert np.all(np.diff(scores.option_C) >= 0)
  want_targets = np.concatenate([t[-n:] for t, n in zip(enc.targets, enc.num_cont_O)])
  np.testing.assert_array_equal(scores.targets_C, want_targets)


def test_accuracy_and_acc_norm_by_hand():
  items = [shared_context("t", 0, "q", ["a", "bbbb"], 1), shared_context("t", 1, "q",
                                                                          ["aa", "b", "c"], 2)]
  s = np.asarray([-1.0, -2.0, -4.0, -3.0, -2.5])
  np.testing.assert_array_equal(scoring.correct(items, s), [0.0, 1.0])
  # acc_norm: -1/1 vs -2/4 -> option 1; -4/2, -3/1, -2.5/1 -> option 0
  np.testing.assert_array_equal(scoring.correct(items, s, norm=True), [1.0, 0.0])


def test_continuation_longer_than_max_len_is_refused():
  tok = ByteTokenizer()
  item = shared_context("t", 7, "ctx", ["y" * (MAX_LEN + 5), "n"], 0)
  with pytest.raises(scoring.OptionTooLongError, match="item 7.*max_len 48"):
    scoring.encode_items([item], tok, MAX_LEN)


def test_whitespace_moves_to_the_continuation():
  assert scoring.move_whitespace("Answer: \n", "x") == ("Answer:", " \nx")
  assert scoring.move_whitespace("Answer:", " x") == ("Answer:", " x")
