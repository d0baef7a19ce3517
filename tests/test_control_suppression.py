"""Suppression (prism_jax/control/suppression.py, measure.py) vs a float64 NumPy reference.

The reference recomputes routing and activations from the hidden states z in float64:
suppression is ℓ' = W (z − Σ_{i∈G∩S_t} a_{t,i} p_i) (r_t = z_t − ẑ_t the unedited one);
refill is ℓ' = W (ẑ' + z − ẑ) with ẑ' the mixture over the top-k of cos(z, p_i), i ∉ G.
"""

import functools
import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from prism_jax.model.prototypes import EPS

from prism_jax.config import model_preset
from prism_jax.control import measure, suppression
from prism_jax.control.suppression import ProtoSet, suppressed_logits
from prism_jax.model.lm import build_model, init_prototypes_from_hidden

VOCAB, SEQ, K, TOP = 48, 12, 16, 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _model(seed=None):
  seed = secrets.randbits(16) if seed is None else seed
  cfg = model_preset("tiny", vocab_size=VOCAB, max_len=SEQ, d_model=32, n_layers=1,
                     n_heads=2, num_prototypes=K, k=TOP, init_std=0.3)
  model = build_model(cfg, seed=seed)
  init_prototypes_from_hidden(model, np.random.default_rng(seed).integers(0, VOCAB, (4, SEQ)),
                              seed=seed)
  return model


def _route(z, p, exclude=()):
  cos = (z / np.linalg.norm(z, axis=-1, keepdims=True)) @ (
      p / np.linalg.norm(p, axis=-1, keepdims=True)).T
  cos[..., list(exclude)] = -np.inf
  idx = np.argsort(-cos, axis=-1, kind="stable")[..., :TOP]
  act = np.maximum(np.take_along_axis(cos, idx, -1), 0.0)
  # the tiny preset's normalised mixture; a token whose k cosines are all <= 0 (possible once
  # the refill excludes prototypes) has weights 0, as the library's EPS guard gives
  return idx, act / np.maximum(act.sum(-1, keepdims=True), EPS)


def _reference(model, z_BxTxD, ids, refill):
  z = np.asarray(z_BxTxD, np.float64)
  w = np.asarray(model.backbone.wte[...], np.float64)
  p = np.asarray(model.bank.protos[...], np.float64)
  idx, act = _route(z, p)
  z_hat = np.einsum("btk,btkd->btd", act, p[idx])
  if refill:
    idx2, act2 = _route(z, p, ids)
    return (np.einsum("btk,btkd->btd", act2, p[idx2]) + z - z_hat) @ w.T
  drop = np.isin(idx, ids) * act
  return (z - np.einsum("btk,btkd->btd", drop, p[idx])) @ w.T


@pytest.mark.parametrize("refill", [False, True])
def test_suppression_matches_float64_reference(refill):
  rng = np.random.default_rng(secrets.randbits(32))
  model = _model()
  out = model(rng.integers(0, VOCAB, (3, SEQ)))
  active = np.unique(np.asarray(out.protos.idx_Nxk))
  ids = rng.choice(active, size=4, replace=False)  # prototypes that are really active
  got = np.asarray(suppressed_logits(model, out, ids, refill=refill))
  want = _reference(model, out.z_BxTxD, ids, refill)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  moved = np.abs(got - np.asarray(out.logits_BxTxV)).max(-1) > 1e-4
  assert moved.any()  # the edit does something...
  hit = np.isin(np.asarray(out.protos.idx_Nxk), ids).any(-1).reshape(moved.shape)
  assert not (moved & ~hit).any()  # ...and only where a suppressed prototype was active


def test_empty_set_is_identity():
  rng = np.random.default_rng(secrets.randbits(32))
  model = _model()
  out = model(rng.integers(0, VOCAB, (2, SEQ)))
  for refill in (False, True):
    np.testing.assert_allclose(np.asarray(suppressed_logits(model, out, [], refill=refill)),
                               np.asarray(out.logits_BxTxV), rtol=1e-5, atol=1e-5)


def test_quality_matches_reference():
  rng = np.random.default_rng(secrets.randbits(32))
  model = _model()
  tokens = rng.integers(0, VOCAB, (5, SEQ + 1))
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  mask = rng.random((5, SEQ)) < 0.8
  ids = rng.choice(K, size=5, replace=False)
  got = measure.quality(model, inputs, targets, mask, ids=ids, batch_size=2)
  out = model(inputs)
  l0 = np.asarray(out.logits_BxTxV, np.float64)
  l1 = _reference(model, out.z_BxTxD, ids, refill=False)
  lp0 = l0 - np.log(np.exp(l0 - l0.max(-1, keepdims=True)).sum(-1, keepdims=True)) - l0.max(-1, keepdims=True)
  lp1 = l1 - np.log(np.exp(l1 - l1.max(-1, keepdims=True)).sum(-1, keepdims=True)) - l1.max(-1, keepdims=True)
  nll = lambda lp: -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(got["ppl_before"], np.exp(nll(lp0)[mask].mean()), rtol=1e-4)
  np.testing.assert_allclose(got["ppl_after"], np.exp(nll(lp1)[mask].mean()), rtol=1e-4)
  kl = (np.exp(lp0) * (lp0 - lp1)).sum(-1)[mask].mean()
  np.testing.assert_allclose(got["kl"], kl, rtol=1e-3, atol=1e-7)
  changed = (l0.argmax(-1) != l1.argmax(-1))[mask].mean()
  np.testing.assert_allclose(got["argmax_change"], changed, atol=1.5 / mask.sum())
  assert got["tokens"] == mask.sum()


def test_generation_suppression_and_ban():
  rng = np.random.default_rng(secrets.randbits(32))
  model = _model()
  prompt = rng.integers(0, VOCAB, (2, 3)).tolist()
  base = suppression.generate_suppressed(model, prompt, max_new_tokens=6)
  ids = np.unique(base.trace.idx_BxLxk[:, :, 0])  # the top prototype of every step
  edited = suppression.generate_suppressed(model, prompt, ids, max_new_tokens=6)
  np.testing.assert_array_equal(  # suppressed prototypes contribute nothing
      edited.trace.contrib_BxLxk[np.isin(edited.trace.idx_BxLxk, ids)], 0.0)
  banned = np.unique(base.tokens_BxL)
  out = suppression.generate_suppressed(model, prompt, ban=banned, max_new_tokens=6)
  assert not np.isin(out.tokens_BxL, banned).any()
  refilled = suppression.generate_suppressed(model, prompt, ids, refill=True, max_new_tokens=6)
  assert refilled.tokens_BxL.shape == (2, 6)


def test_set_save_load_and_bad_input(tmp_path):
  model = _model()
  pset = ProtoSet.create(model, [3, 1, 7], [0.9, 0.5, 0.2], method="probe", query="q")
  path = pset.save(str(tmp_path))
  assert path.endswith("suppression_sets/probe.json")
  assert ProtoSet.load(path, model) == pset
  assert json.load(open(path))["fingerprint"]["num_prototypes"] == K
  other = _model(seed=70000)  # outside randbits(16): never the model the set was saved for
  with pytest.raises(ValueError, match="saved for another model: bank_sha256"):
    ProtoSet.load(path, other)
  with pytest.raises(ValueError, match=r"prototype ids must be in \[0, 16\), got \[16, -1\]"):
    ProtoSet.create(model, [0, 16, -1])
  with pytest.raises(ValueError, match="empty prototype selection"):
    ProtoSet.create(model, [])
  with pytest.raises(ValueError, match="prototype ids must be in"):
    suppressed_logits(model, model(np.zeros((1, 2), np.int32) + 3), [K])
  with pytest.raises(ValueError, match="duplicate"):
    ProtoSet.create(model, [2, 2])
  with pytest.raises(ValueError, match="token ids must be in"):
    suppression.ban_hook([VOCAB], VOCAB)
  dense = build_model(model_preset("tiny", kind="dense", vocab_size=VOCAB, max_len=SEQ,
                                   d_model=32, n_layers=1, n_heads=2))
  with pytest.raises(ValueError, match="needs a PrismLM"):
    suppression.check_ids(dense, [0])
  (tmp_path / "x.json").write_text('{"format": "other"}')
  with pytest.raises(ValueError, match="is not a suppression set"):
    ProtoSet.load(str(tmp_path / "x.json"), model)


@pytest.mark.parametrize("module, args, fragment", [
    ("suppress", ["--workdir={w}", "--behaviour=nsfw"], "unknown behaviour 'nsfw'"),
    ("suppress", ["--workdir={w}/none", "--behaviour=planted"], "none"),
    ("planted_corpus", ["--out={w}", "--neutral_docs=0"], "neutral_docs must be in"),
])
def test_cli_bad_input_is_one_line(tmp_path, module, args, fragment):
  cmd = ["prism_jax.cli", module] if module == "suppress" else [f"experiments.{module}"]
  proc = subprocess.run([sys.executable, "-m", *cmd, *[a.format(w=tmp_path) for a in args]],
                        cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert proc.returncode == 2 and len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_set_save_load_on_gcs(gcs):
  """A set saved beside a run in a bucket (issue 19's gs:// paths): loaded back equal,
  refused for another bank."""
  del gcs  # the emulator's environment is set for the session
  model = _model()
  pset = ProtoSet.create(model, [5, 2], [0.7, 0.1], method="keywords", query="q")
  path = pset.save("gs://bucket/suppress_run/sets.json")
  assert path == "gs://bucket/suppress_run/sets.json"
  assert ProtoSet.load(path, model) == pset
  with pytest.raises(ValueError, match="another model"):
    ProtoSet.load(path, _model(seed=70000))
