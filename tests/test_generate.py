"""Generation: cached == uncached, exact logit decomposition, sampling, EOS, suppression.

Models are tiny with a large init (peaked, non-flat logits) and a data-initialised bank;
prompts are fresh random ids (the seed is in every failure message). References are
float64 NumPy re-computations from the teacher-forced hidden states z.
"""

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prism_jax.analysis.token_report import token_report, token_rows
from prism_jax.config import model_preset
from prism_jax.control.steering import suppression_gains
from prism_jax.generate import filter_logits, generate, top_k_filter
from prism_jax.model.lm import build_model, init_prototypes_from_hidden

VOCAB, MAX_LEN, PROMPT, STEPS = 64, 24, 5, 10
MODEL_SEEDS = {}  # reported in failure messages with the prompt seed


def _model(kind, mixture="raw"):
  cfg = model_preset("tiny", kind=kind, vocab_size=VOCAB, max_len=MAX_LEN, d_model=32,
                     n_layers=2, n_heads=2, num_prototypes=16, k=4, init_std=0.3,
                     mixture=mixture)
  MODEL_SEEDS[f"{kind}/{mixture}"] = seed = secrets.randbits(16)
  model = build_model(cfg, seed=seed)
  if kind == "prism":
    tokens = np.random.default_rng(1).integers(0, VOCAB, (4, MAX_LEN))
    init_prototypes_from_hidden(model, tokens, seed=0)
  return model


@pytest.fixture(scope="module")
def prism():
  return _model("prism")


@pytest.fixture(scope="module")
def dense():
  return _model("dense")


def _prompt(batch=2, length=PROMPT):
  seed = secrets.randbits(32)
  return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)), seed


def _reference(model, prompt, tokens, gains=None):
  """Teacher-forced float64 decomposition of every generated token (raw or normalised)."""
  seq = np.concatenate([prompt, tokens], axis=1)
  z = np.asarray(model(seq).z_BxTxD, np.float64)[:, prompt.shape[1] - 1:-1]  # B, L, D
  w = np.asarray(model.backbone.wte[...], np.float64)
  p = np.asarray(model.bank.protos[...], np.float64)
  cos = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (
      p / np.linalg.norm(p, axis=-1, keepdims=True)).T
  idx = np.argsort(-cos, axis=-1, kind="stable")[..., :model.cfg.k]
  act = np.maximum(np.take_along_axis(cos, idx, -1), 0.0)
  if model.cfg.mixture == "normalized":
    act = act / act.sum(-1, keepdims=True)
  residual_vec = z - np.einsum("blk,blkd->bld", act, p[idx])
  g = np.ones(len(p)) if gains is None else np.asarray(gains, np.float64)
  eff = act * g[idx]
  logits = residual_vec @ w.T + np.einsum("blk,blkd->bld", eff, p[idx]) @ w.T
  w_y = w[tokens]
  contrib = eff * np.einsum("blkd,bld->blk", p[idx], w_y)
  return dict(idx=idx, act=act, contrib=contrib, logits=logits,
              proto_logits=np.einsum("blk,blkd->bld", eff, p[idx]) @ w.T,
              residual=np.einsum("bld,bld->bl", residual_vec, w_y))


def _check_trust(tr, ref, msg):
  """The trace's trust marks against the float64 logits (gains applied) of the reference,
  where float32 rounding cannot flip an order (both the top-2 gap and the prototype
  path's top-2 gap clear by 1e-3)."""
  full, proto = ref["logits"], ref["proto_logits"]
  top2 = np.sort(full, -1)[..., -2:]
  ptop2 = np.sort(proto, -1)[..., -2:]
  clear = (top2[..., 1] - top2[..., 0] > 1e-3) & (ptop2[..., 1] - ptop2[..., 0] > 1e-3)
  assert clear.mean() > 0.5, msg
  top1 = full.argmax(-1)
  runner = np.argsort(-full, -1, kind="stable")[..., 1]
  agrees = proto.argmax(-1) == top1
  take = lambda x, i: np.take_along_axis(x, i[..., None], -1)[..., 0]
  share = (take(proto, top1) - take(proto, runner)) / (take(full, top1) - take(full, runner))
  np.testing.assert_array_equal(tr.agrees_BxL[clear], agrees[clear], err_msg=msg)
  np.testing.assert_array_equal(tr.proto_top1_BxL[clear], proto.argmax(-1)[clear], err_msg=msg)
  big = clear & (top2[..., 1] - top2[..., 0] > 0.05)  # a share divides by the gap
  np.testing.assert_allclose(tr.proto_share_BxL[big], share[big], rtol=1e-2, atol=1e-2,
                             err_msg=msg)


@pytest.mark.parametrize("kind", ["prism", "dense"])
def test_cached_equals_uncached_greedy(kind, prism, dense):
  model = prism if kind == "prism" else dense
  prompt, seed = _prompt()
  ref = generate(model, prompt, max_new_tokens=STEPS, use_cache=False)
  for loop in ("device", "host") if kind == "prism" else ("device",):
    out = generate(model, prompt, max_new_tokens=STEPS, loop=loop)
    np.testing.assert_array_equal(out.tokens_BxL, ref.tokens_BxL,
                                  err_msg=f"seed {seed} models {MODEL_SEEDS} {loop}")
    np.testing.assert_allclose(out.logit_BxL, ref.logit_BxL, rtol=1e-5, atol=1e-4)
  if kind == "prism":
    np.testing.assert_array_equal(out.trace.idx_BxLxk, ref.trace.idx_BxLxk)
    np.testing.assert_allclose(out.trace.contrib_BxLxk, ref.trace.contrib_BxLxk, atol=1e-4)
  # Greedy picks the argmax of the teacher-forced logits at every step.
  seq = np.concatenate([prompt, ref.tokens_BxL], axis=1)
  logits = np.asarray(model(seq).logits_BxTxV)[:, PROMPT - 1:-1]
  np.testing.assert_array_equal(logits.argmax(-1), ref.tokens_BxL,
                                err_msg=f"seed {seed} models {MODEL_SEEDS}")


@pytest.mark.parametrize("mixture", ["raw", "normalized"])
def test_trace_decomposes_the_sampled_logit(mixture, prism):
  model = prism if mixture == "raw" else _model("prism", mixture)
  prompt, seed = _prompt()
  # top_p < 1 only to share the compiled program with the other sampling tests.
  out = generate(model, prompt, max_new_tokens=STEPS, temperature=1.0, top_p=0.999, seed=seed)
  ref = _reference(model, prompt, out.tokens_BxL)
  tr = out.trace
  msg = f"seed {seed} models {MODEL_SEEDS}"
  np.testing.assert_allclose(tr.contrib_BxLxk.sum(-1) + tr.residual_BxL, out.logit_BxL,
                             rtol=1e-5, atol=1e-4, err_msg=msg)
  np.testing.assert_array_equal(tr.idx_BxLxk, ref["idx"], err_msg=msg)
  np.testing.assert_allclose(tr.act_BxLxk, ref["act"], atol=1e-4, err_msg=msg)
  np.testing.assert_allclose(tr.contrib_BxLxk, ref["contrib"], atol=1e-3, err_msg=msg)
  np.testing.assert_allclose(tr.residual_BxL, ref["residual"], atol=1e-3, err_msg=msg)
  sampled = np.take_along_axis(ref["logits"], out.tokens_BxL[..., None], -1)[..., 0]
  np.testing.assert_allclose(out.logit_BxL, sampled, atol=1e-3, err_msg=msg)
  _check_trust(tr, ref, msg)


def test_suppression_edits_exactly_the_suppressed_prototypes(prism):
  prompt, seed = _prompt()
  plain = generate(prism, prompt, max_new_tokens=STEPS)
  # Suppress the strongest prototype of each row's first token plus two random ones.
  rng = np.random.default_rng(seed)
  ids = set(plain.trace.idx_BxLxk[:, 0, 0].tolist()) | set(rng.choice(16, 2).tolist())
  gains = suppression_gains(16, sorted(ids))
  out = generate(prism, prompt, max_new_tokens=STEPS, proto_gain_K=gains)
  ref = _reference(prism, prompt, out.tokens_BxL, gains)
  tr, msg = out.trace, f"seed {seed} models {MODEL_SEEDS}, suppressed {sorted(ids)}"
  suppressed = np.isin(tr.idx_BxLxk, sorted(ids))
  assert suppressed[:, 0].any(), msg
  # Routing and the residual come from the unedited pass; only suppressed shares vanish.
  np.testing.assert_array_equal(tr.idx_BxLxk, ref["idx"], err_msg=msg)
  np.testing.assert_allclose(tr.act_BxLxk, ref["act"], atol=1e-4, err_msg=msg)
  np.testing.assert_array_equal(tr.contrib_BxLxk[suppressed], 0.0, err_msg=msg)
  np.testing.assert_allclose(tr.contrib_BxLxk, ref["contrib"], atol=1e-3, err_msg=msg)
  np.testing.assert_allclose(tr.residual_BxL, ref["residual"], atol=1e-3, err_msg=msg)
  # Greedy under suppression = argmax of ℓ − Σ_{G∩S} a W p at every step.
  np.testing.assert_array_equal(out.tokens_BxL, ref["logits"].argmax(-1), err_msg=msg)
  np.testing.assert_allclose(tr.contrib_BxLxk.sum(-1) + tr.residual_BxL, out.logit_BxL,
                             rtol=1e-5, atol=1e-4, err_msg=msg)
  _check_trust(tr, ref, msg)  # the trust of the edited logits: W z_hat with the gains
  # At step 0 (same prefix) unsuppressed prototypes keep their share of the same token.
  if (out.tokens_BxL[:, 0] == plain.tokens_BxL[:, 0]).all():
    np.testing.assert_allclose(tr.contrib_BxLxk[:, 0][~suppressed[:, 0]],
                               plain.trace.contrib_BxLxk[:, 0][~suppressed[:, 0]], atol=1e-5)
  with pytest.raises(ValueError, match=r"prototype ids must be in \[0, 16\)"):
    suppression_gains(16, [3, 16])


def test_logit_hook_bans_a_token(dense):
  prompt, seed = _prompt()
  plain = generate(dense, prompt, max_new_tokens=STEPS)
  banned = int(plain.tokens_BxL[0, 0])
  hook = lambda logits, protos: logits.at[:, banned].set(-1e9)
  out = generate(dense, prompt, max_new_tokens=STEPS, logit_hook=hook)
  assert (out.tokens_BxL != banned).all(), f"seed {seed} models {MODEL_SEEDS}"


def test_top_k_one_and_tiny_top_p_equal_greedy(prism):
  prompt, seed = _prompt()
  greedy = generate(prism, prompt, max_new_tokens=STEPS)
  for kwargs in (dict(top_k=1), dict(top_p=1e-6)):
    out = generate(prism, prompt, max_new_tokens=STEPS, temperature=1.5, seed=seed, **kwargs)
    np.testing.assert_array_equal(out.tokens_BxL, greedy.tokens_BxL,
                                  err_msg=f"{kwargs} seed {seed} models {MODEL_SEEDS}")


def test_filter_logits_matches_numpy():
  rng = np.random.default_rng(secrets.randbits(32))
  logits = rng.normal(size=(3, 40)).astype(np.float32) * 2
  top_k, top_p = 7, 0.6
  got = np.asarray(filter_logits(logits, top_k, 1.0)) > -1e30
  want = logits >= np.sort(logits, -1)[:, -top_k][:, None]
  np.testing.assert_array_equal(got, want)
  got = np.asarray(filter_logits(logits, None, top_p)) > -1e30
  for row, keep in zip(logits.astype(np.float64), got):
    order = np.argsort(-row)
    probs = np.exp(row[order] - row.max())
    probs /= probs.sum()
    n_keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)  # smallest set with mass >= p
    assert set(np.flatnonzero(keep)) == set(order[:n_keep].tolist())


def test_traced_top_k_filter_is_the_static_one_and_numpys():
  # the explorer samples with a traced k (one program for every k): same cut as lax.top_k's
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  logits = rng.permutation(np.arange(120, dtype=np.float32)).reshape(3, 40) / 7  # tie-free
  traced = jax.jit(top_k_filter)
  for top_k in (1, int(rng.integers(2, 40)), 40, 55):
    want = logits >= np.sort(logits, -1)[:, -min(top_k, 40)][:, None]
    got = np.asarray(traced(logits, jnp.int32(top_k)))
    np.testing.assert_array_equal(got > -1e30, want, err_msg=f"seed {seed} top_k {top_k}")
    np.testing.assert_array_equal(got[want], logits[want])
    if top_k <= 40:
      np.testing.assert_array_equal(got, np.asarray(top_k_filter(logits, top_k)))


def test_sampling_is_reproducible_with_a_fixed_seed(prism):
  prompt, seed = _prompt()
  kwargs = dict(max_new_tokens=STEPS, temperature=2.0, top_p=0.95)
  a = generate(prism, prompt, seed=seed, **kwargs)
  b = generate(prism, prompt, seed=seed, **kwargs)
  np.testing.assert_array_equal(a.tokens_BxL, b.tokens_BxL)
  others = [generate(prism, prompt, seed=seed + i, **kwargs).tokens_BxL for i in (1, 2, 3)]
  assert any((o != a.tokens_BxL).any() for o in others), (
      f"seed {seed} models {MODEL_SEEDS}: sampling ignores the seed")


def test_eos_stops_each_row(prism):
  prompt, seed = _prompt()
  free = generate(prism, prompt, max_new_tokens=STEPS)
  eos = int(free.tokens_BxL[0, 2])  # row 0 stops at step 2 (or earlier)
  for loop in ("device", "host"):
    out = generate(prism, prompt, max_new_tokens=STEPS, eos_id=eos, loop=loop)
    for row in range(2):
      hits = np.flatnonzero(free.tokens_BxL[row] == eos)
      n = int(hits[0]) + 1 if hits.size else STEPS
      msg = f"seed {seed} models {MODEL_SEEDS} row {row} {loop}"
      assert out.lengths_B[row] == n, msg
      np.testing.assert_array_equal(out.tokens_BxL[row, :n], free.tokens_BxL[row, :n], msg)
      np.testing.assert_array_equal(out.tokens_BxL[row, n:], eos, msg)
      np.testing.assert_array_equal(out.trace.contrib_BxLxk[row, n:], 0.0, msg)
  assert len(token_rows(out, row=0)) == out.lengths_B[0]
  # Every row stops early (the loop exits before max_new_tokens): the tail is still EOS.
  same = np.repeat(prompt[:1], 2, axis=0)
  out = generate(prism, same, max_new_tokens=STEPS, eos_id=eos)
  n = int(np.flatnonzero(free.tokens_BxL[0] == eos)[0]) + 1
  np.testing.assert_array_equal(out.lengths_B, [n, n])
  np.testing.assert_array_equal(out.tokens_BxL[:, n:], eos)


def test_bad_arguments_are_clear_errors(prism, dense):
  prompt, _ = _prompt()
  with pytest.raises(ValueError, match="exceeds model.max_len=24"):
    generate(prism, prompt, max_new_tokens=MAX_LEN - PROMPT + 1)
  with pytest.raises(ValueError, match="equal length"):
    generate(prism, [[1, 2, 3], [4, 5]])
  with pytest.raises(ValueError, match="vocab_size"):
    generate(prism, [[1, VOCAB]])
  with pytest.raises(ValueError, match="needs a PrismLM"):
    generate(dense, prompt, max_new_tokens=3, proto_gain_K=np.ones(16))
  with pytest.raises(ValueError, match="top_p"):
    generate(prism, prompt, max_new_tokens=3, temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):
    generate(prism, prompt, max_new_tokens=3, temperature=1.0, top_k=0)


def test_token_report_lists_prototypes(prism):
  prompt, _ = _prompt()
  out = generate(prism, prompt, max_new_tokens=STEPS)
  text = token_report(out, lambda ids: " ".join(f"t{i}" for i in ids), top=2)
  lines = text.splitlines()
  assert len(lines) == 3 + STEPS
  for t in range(STEPS):  # each token's trust mark is its trace's
    assert ("| RESIDUAL" in lines[2 + t]) == (not out.trace.agrees_BxL[0, t]), lines[2 + t]
  decided = int((~out.trace.agrees_BxL[0]).sum())
  assert lines[-1].startswith(f"trust: the prototypes pick the model's top-1 on "
                              f"{STEPS - decided} of {STEPS} tokens")
  first = out.trace
  j = int(np.argmax(first.contrib_BxLxk[0, 0]))
  assert f"#{first.idx_BxLxk[0, 0, j]} a=" in lines[2]
