"""Issue 18's speed changes leave the maths alone: each against an independent reference.

- reference.top_k (k argmax passes on CPU) returns lax.top_k's exact values, indices and
  gradients, ties, signed zeros and -inf included;
- losses.token_nll (logsumexp - iota-picked logit) and its gradient against float64 NumPy;
- transformer.materialize (the CPU optimization barrier on the residual stream) changes no
  value: logits and gradients with it equal those without it to float32 rounding;
- experiments.bench_train refuses a baseline that is not a checkout.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.topk_reconstruct import reference
from prism_jax import losses
from prism_jax.config import ModelConfig
from prism_jax.model import build_model
from prism_jax.model import transformer


@pytest.mark.parametrize("k", [1, 3, 8, 32, 47])
def test_top_k_equals_lax_top_k_with_ties_signed_zeros_and_inf(k):
  rng = np.random.default_rng(k)
  x = np.round(rng.normal(size=(37, 48)), 1).astype(np.float32)  # many exact ties
  x[rng.random(x.shape) < 0.1] = 0.0
  x[rng.random(x.shape) < 0.1] = -0.0
  x[rng.random(x.shape) < 0.2] = -np.inf
  x[0] = -np.inf  # a row with nothing but -inf
  vals, idx = jax.jit(reference.top_k, static_argnums=1)(x, k)
  ref_vals, ref_idx = jax.lax.top_k(x, k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  np.testing.assert_array_equal(np.signbit(vals), np.signbit(ref_vals))
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
  if k <= reference.ARGMAX_TOPK_MAX_K:  # the argmax path ran (CPU tests), not lax.top_k
    assert jax.default_backend() == "cpu"


def test_top_k_gradient_goes_to_the_selected_entries():
  rng = np.random.default_rng(0)
  x = np.round(rng.normal(size=(30, 20)), 1).astype(np.float32)
  ct = rng.normal(size=(30, 6)).astype(np.float32)
  grad = jax.grad(lambda a: jnp.vdot(reference.top_k(a, 6)[0], ct))(x)
  _, idx = jax.lax.top_k(x, 6)
  expected = np.zeros_like(x)
  np.put_along_axis(expected, np.asarray(idx), ct, axis=1)  # brute force: one-hot scatter
  np.testing.assert_array_equal(np.asarray(grad), expected)


def test_token_nll_and_gradient_vs_float64():
  rng = np.random.default_rng(1)
  logits = (rng.normal(size=(3, 5, 33)) * 4).astype(np.float32)
  targets = rng.integers(0, 33, size=(3, 5))
  ct = rng.normal(size=(3, 5))
  nll, vjp = jax.vjp(lambda l: losses.token_nll(l, jnp.asarray(targets)), logits)
  (grad,) = vjp(jnp.asarray(ct, jnp.float32))
  l64 = logits.astype(np.float64)
  lse = np.log(np.exp(l64 - l64.max(-1, keepdims=True)).sum(-1)) + l64.max(-1)
  ref = lse - np.take_along_axis(l64, targets[..., None], -1)[..., 0]
  softmax = np.exp(l64 - lse[..., None])
  ref_grad = ct[..., None] * (softmax - np.eye(33)[targets])
  np.testing.assert_allclose(np.asarray(nll), ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-6)
  inf_logits = logits.copy()
  inf_logits[0, 0, targets[0, 0]] = -np.inf  # an impossible target costs +inf, as before
  assert np.isposinf(np.asarray(losses.token_nll(inf_logits, jnp.asarray(targets)))[0, 0])


@pytest.fixture(scope="module")
def prism_model():
  cfg = ModelConfig(vocab_size=61, max_len=16, d_model=32, n_layers=2, n_heads=2,
                    num_prototypes=24, k=3)
  return build_model(cfg, seed=4)


def _loss_and_grads(model, tokens):
  graphdef, params = nnx.split(model)

  def loss(p):
    out = nnx.merge(graphdef, p)(tokens)
    return losses.cross_entropy(out.logits_BxTxV.reshape(-1, 61), tokens.reshape(-1),
                                jnp.ones(tokens.size, bool)), out.logits_BxTxV

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def test_materialize_changes_no_value(prism_model, monkeypatch):
  # The barrier is really in the CPU program (the comparison below would be vacuous else).
  assert "optimization_barrier" in str(jax.make_jaxpr(transformer.materialize)(jnp.ones(3)))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 61, size=(3, 16)), jnp.int32)
  (loss, logits), grads = _loss_and_grads(prism_model, tokens)
  monkeypatch.setattr(transformer, "materialize", lambda x: x)
  (ref_loss, ref_logits), ref_grads = _loss_and_grads(prism_model, tokens)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)


def test_bench_train_refuses_a_baseline_that_is_not_a_checkout(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-m", "experiments.bench_train", "--configs=byte",
                        f"--baseline={tmp_path}"], cwd=repo, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert res.returncode == 2
  assert res.stderr.strip().splitlines()[-1].startswith("error: --baseline=")
  assert "is not a checkout of prism_jax" in res.stderr
