"""The control edit (PRISM.md §6) on teacher-forced (B, T, V) logits vs a float64 reference.

The reference recomputes routing and activations from the model's hidden states z in
float64 NumPy and forms ℓ' = W (z − Σ_{i∈S_t} (1 − g_i) a_{t,i} p_i): the residual
r_t = z_t − ẑ_t is the unedited one, so only the active prototypes' shares move.
"""

import functools
import secrets

import jax
import numpy as np
import pytest

from prism_jax.config import model_preset
from prism_jax.model.lm import build_model, init_prototypes_from_hidden
from prism_jax.control.steering import suppression_gains
from prism_jax.model.logit_edit import controlled_logits

VOCAB, SEQ, K, TOP = 48, 12, 16, 4
SEEDS = {}  # model seeds, reported in failure messages


@functools.cache  # one model per kind and mixture, at a fresh seed, per session
def _model(kind="prism", mixture="raw"):
  seed = SEEDS[f"{kind}/{mixture}"] = secrets.randbits(16)
  cfg = model_preset("tiny", kind=kind, vocab_size=VOCAB, max_len=SEQ, d_model=32,
                     n_layers=1, n_heads=2, num_prototypes=K, k=TOP, init_std=0.3,
                     mixture=mixture)
  model = build_model(cfg, seed=seed)
  if kind == "prism":
    init_prototypes_from_hidden(model, np.random.default_rng(seed).integers(0, VOCAB, (4, SEQ)),
                                seed=seed)
  return model


def _reference(model, z_BxTxD, gains_K):
  z = np.asarray(z_BxTxD, np.float64)
  w = np.asarray(model.backbone.wte[...], np.float64)
  p = np.asarray(model.bank.protos[...], np.float64)
  cos = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (
      p / np.linalg.norm(p, axis=-1, keepdims=True)).T
  idx = np.argsort(-cos, axis=-1, kind="stable")[..., :TOP]
  act = np.maximum(np.take_along_axis(cos, idx, -1), 0.0)
  if model.cfg.mixture == "normalized":
    act = act / act.sum(-1, keepdims=True)
  drop = (1.0 - np.asarray(gains_K, np.float64)[idx]) * act  # B, T, k
  edited_z = z - np.einsum("btk,btkd->btd", drop, p[idx])
  return edited_z @ w.T


@pytest.mark.parametrize("mixture", ["raw", "normalized"])
def test_edited_logits_match_float64_reference(mixture):
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  model = _model(mixture=mixture)
  tokens = rng.integers(0, VOCAB, (3, SEQ))
  out = model(tokens)
  gains = rng.uniform(-1.0, 2.0, K).astype(np.float32)  # suppression and amplification
  got = np.asarray(jax.jit(controlled_logits)(model, out, gains))
  assert got.shape == (3, SEQ, VOCAB)
  want = _reference(model, out.z_BxTxD, gains)
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=1e-5 * scale,
                             err_msg=f"seed {seed} models {SEEDS}")
  # The edit is not a no-op here: the reference moves the logits well beyond the tolerance.
  assert np.abs(want - np.asarray(out.logits_BxTxV, np.float64)).max() > 1e-2 * scale


def test_unit_gains_are_the_identity_and_suppression_zeroes_a_share():
  seed = secrets.randbits(32)
  rng = np.random.default_rng(seed)
  model = _model()
  out = model(rng.integers(0, VOCAB, (2, SEQ)))
  same = controlled_logits(model, out, np.ones(K, np.float32))
  np.testing.assert_array_equal(np.asarray(same), np.asarray(out.logits_BxTxV))
  ids = np.unique(np.asarray(out.protos.idx_Nxk)[:, 0])[:3]
  got = np.asarray(controlled_logits(model, out, suppression_gains(K, ids)), np.float64)
  gains = np.ones(K)
  gains[ids] = 0.0
  want = _reference(model, out.z_BxTxD, gains)
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(),
                             err_msg=f"seed {seed} models {SEEDS}")


def test_suppression_gains_and_bad_inputs():
  np.testing.assert_array_equal(np.asarray(suppression_gains(5, [1, 3])), [1, 0, 1, 0, 1])
  np.testing.assert_array_equal(np.asarray(suppression_gains(3, [])), [1, 1, 1])
  with pytest.raises(ValueError, match=r"prototype ids must be in \[0, 16\), got \[-1, 16\]"):
    suppression_gains(16, [-1, 3, 16])
  with pytest.raises(ValueError, match="prototype ids must be integers"):
    suppression_gains(16, [1.5])
  model = _model()
  out = model(np.zeros((1, 4), np.int32) + 7)
  with pytest.raises(ValueError, match=r"gains_K must have shape \(K,\)=\(16,\), got \(15,\)"):
    controlled_logits(model, out, np.ones(15, np.float32))
  dense = _model("dense")
  with pytest.raises(ValueError, match="needs a PrismLM"):
    controlled_logits(dense, dense(np.zeros((1, 4), np.int32)), np.ones(K, np.float32))
