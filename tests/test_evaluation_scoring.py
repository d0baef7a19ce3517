"""The scoring harness vs a float64 brute force: each option's window run alone through the
model at its own length, log-probabilities from a float64 log-sum-exp over the vocabulary,
the continuation tokens chosen by lm-eval's rules written out here independently."""

import functools
import secrets

import numpy as np
import pytest
from flax import nnx

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


# The window alone at its own length, compiled whole (one program per length; op-by-op
# dispatch compiled every op for every length).
_hidden = nnx.jit(lambda model, ids: model(ids).z_BxTxD)


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
    z = np.asarray(_hidden(model, np.asarray([seq[:-1]], np.int32))[0], np.float64)
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


def test_continuation_longer_than_max_len_is_refused_on_request():
  tok = ByteTokenizer()
  item = shared_context("t", 7, "ctx", ["y" * (MAX_LEN + 5), "n"], 0)
  with pytest.raises(scoring.OptionTooLongError, match="item 7.*max_len 48"):
    scoring.encode_items([item], tok, MAX_LEN, too_long="refuse")
  with pytest.raises(ValueError, match="too_long='skip'"):
    scoring.encode_items([item], tok, MAX_LEN, too_long="skip")


def test_left_truncation_against_hand_built_requests():
  """Byte tokens are the text's bytes, so each window is written out as text: lm-eval's
  last max_len + 1 tokens of context + continuation, the continuation's tokens scored."""
  tok = ByteTokenizer()
  rng = np.random.default_rng(secrets.randbits(16))
  letters = lambda n: "".join(rng.choice(list("abcdefghij"), n))
  ctx, short, long_cont = letters(70), " " + letters(5), " " + letters(60)
  items = [shared_context("t", 0, ctx, [short[1:], long_cont[1:]], 0)]  # it adds the " "
  enc = scoring.encode_items(items, tok, MAX_LEN)
  # option 0: the context loses its head, the 6-token continuation is whole
  window0 = (ctx[-(MAX_LEN + 1 - len(short)):] + short).encode()
  # option 1: the 61-token continuation alone overflows: the window is its last 49 bytes,
  # the first of them only conditions, the other 48 are scored; the context is gone
  window1 = long_cont[-(MAX_LEN + 1):].encode()
  for o, (window, n_scored, n_cut) in enumerate([(window0, len(short), 0),
                                                   (window1, MAX_LEN, len(long_cont) - MAX_LEN)]):
    np.testing.assert_array_equal(enc.inputs[o], list(window[:-1]))
    np.testing.assert_array_equal(enc.targets[o], list(window[1:]))
    assert enc.num_cont_O[o] == n_scored and enc.cont_cut_O[o] == n_cut
    assert enc.truncated_O[o]
  # the scores: float64 log-probabilities of the hand-built windows' scored tokens
  model = _model("dense", tok.vocab_size)
  got = scoring.score_options(model, enc, batch_rows=2).logprob_O
  w = np.asarray(model.backbone.wte[...], np.float64)
  for o, (window, n_scored) in enumerate([(window0, len(short)), (window1, MAX_LEN)]):
    seq = list(window)
    z = np.asarray(_hidden(model, np.asarray([seq[:-1]], np.int32))[0], np.float64)
    logits = z @ w.T
    m = logits.max(1, keepdims=True)
    logp = logits - (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))
    want = logp[np.arange(len(seq) - 1), seq[1:]][-n_scored:].sum()
    np.testing.assert_allclose(got[o], want, rtol=2e-5, atol=2e-4, err_msg=f"seeds {SEEDS}")
  # dropping stays an explicit option: only the item whose options all fit is kept
  fits = shared_context("t", 1, ctx, [short[1:], short[1:] + "x"], 1)
  kept, dropped = scoring.drop_too_long(items + [fits], tok, MAX_LEN)
  assert kept == [fits] and dropped == 1


def test_whitespace_moves_to_the_continuation():
  assert scoring.move_whitespace("Answer: \n", "x") == ("Answer:", " \nx")
  assert scoring.move_whitespace("Answer:", " x") == ("Answer:", " x")


def test_evaluate_tasks_accuracy_equals_float64_brute_force(tmp_path):
  """prism_jax.task_comparison's whole-run path (`prism evaluate` without controllers): a user
  .jsonl task loaded, both models scored, each accuracy = argmax of the float64 option
  log-probabilities by hand (items whose top two lie within rounding are left out)."""
  import json  # pylint: disable=import-outside-toplevel
  from prism_jax import task_comparison  # pylint: disable=import-outside-toplevel
  tok = ByteTokenizer()
  models = {"prism": _model("prism", tok.vocab_size), "dense": _model("dense", tok.vocab_size)}
  rng = np.random.default_rng(secrets.randbits(16))
  words = ["cat", "mat", "dog", "home", "far", "x", "ran again"]
  docs = [{"context": " ".join(rng.choice(words, int(rng.integers(2, 8)))),
           "choices": [" ".join(rng.choice(words, int(rng.integers(1, 4))))
                       for _ in range(int(rng.integers(2, 5)))]} for _ in range(12)]
  for d in docs:
    d["gold"] = int(rng.integers(len(d["choices"])))
  path = tmp_path / "user_task.jsonl"
  path.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
  task_set = task_comparison.load_tasks([str(path)], None, tok, MAX_LEN)
  items = task_set.items[str(path)]
  assert len(items) == len(docs) and task_set.dropped == {}
  rows, controllers, traces = task_comparison.evaluate_tasks(task_set, models["prism"],
                                                     models["dense"], tok, None)
  assert len(rows) == 1 and controllers == {} and traces == {}
  row = rows[0]
  assert row["n_eval"] == len(docs) and row["n_calibration"] == 0
  assert row["chance"] == pytest.approx(np.mean([1 / len(d["choices"]) for d in docs]))
  for name, model in models.items():
    ref = [_reference(model, tok, it) for it in items]
    clear = [np.sort(r)[-1] - np.sort(r)[-2] > 1e-3 for r in ref]
    want = np.asarray([np.argmax(r) == it.gold for r, it in zip(ref, items)], float)
    scores = scoring.score_options(model, scoring.encode_items(items, tok, MAX_LEN))
    got = scoring.correct(items, scores.logprob_O)
    np.testing.assert_array_equal(got[clear], want[clear], err_msg=f"seeds {SEEDS}")
    assert row["acc"][name][0] == pytest.approx(got.mean())
