"""Hessian blocks of the prototype bank against autodiff / NumPy references (PRISM.md §4)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prism_jax.attribution.hessians import curvature as cv
from prism_jax.attribution.hessians import hessian as hs
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.model.lm import build_model

LOSS = LossConfig(lambda_rec=0.3, lambda_r1=0.2, lambda_r2=0.1)
V, D, K, KA = 11, 8, 6, 2


def _rel(x, y):
  return float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y)))


@pytest.fixture(scope="module")
def model():
  """One micro PrismLM (building one costs seconds); tests draw fresh banks and batches."""
  cfg = ModelConfig(vocab_size=V, max_len=8, d_model=D, n_layers=1, n_heads=2,
                    num_prototypes=K, k=KA, init_std=0.3)
  return build_model(cfg, 0)


def _fresh_bank(model, seed):
  model.bank.protos[...] = jnp.asarray(np.random.default_rng(seed).normal(size=(K, D)),
                                       jnp.float32)
  return model


def _batch(seed, b=2, t=5):
  rng = np.random.default_rng(seed)
  mask = rng.random((b, t)) > 0.2
  mask[0, 0] = True
  return dict(inputs=rng.integers(0, V, (b, t)).astype(np.int32),
              targets=rng.integers(0, V, (b, t)).astype(np.int32), mask=mask)


def _np_G_t(model, batch):
  """Per-token true Fisher W^T (diag pi - pi pi^T) W in float64 NumPy (straight-through)."""
  head = cv.head_inputs(model, batch)
  z = np.asarray(head.z_NxD, np.float64)
  w = np.asarray(head.wte_VxD, np.float64)
  logits = z @ w.T  # the straight-through logits equal W z in value
  pi = np.exp(logits - logits.max(1, keepdims=True))
  pi /= pi.sum(1, keepdims=True)
  m = w.T @ pi.T
  g_t = np.einsum("nv,va,vb->nab", pi, w, w) - np.einsum("an,bn->nab", m, m)
  g_emp = (pi - np.eye(V)[np.asarray(head.targets_N)]) @ w  # W^T (pi - e_y)
  return g_t, g_emp, np.asarray(head.mask_N)


def test_bank_loss_and_output_grads_match_library(model):
  model, batch = _fresh_bank(model, 3), _batch(3)
  head, spec = cv.head_inputs(model, batch), cv.check_model(model)
  lib = jax.jit(hs.library_bank_loss(model, batch, LOSS))
  p0 = head.protos_KxD
  np.testing.assert_allclose(cv.bank_loss(p0, head, spec, LOSS), lib(p0), rtol=1e-5)
  grad_lib = jax.jit(jax.grad(lib))(p0)
  grad_ours = jax.grad(lambda p: cv.bank_loss(p, head, spec, LOSS))(p0)
  assert _rel(grad_ours, grad_lib) < 1e-5
  # g_t = W^T (pi_t - e_y) and the linear-path gradient (1/N) sum_t a_t g_t^T.
  og = cv.output_grads(model, batch, LOSS)
  _, g_emp, mask = _np_G_t(model, batch)
  np.testing.assert_allclose(og.g_NxD, g_emp * mask[:, None], atol=1e-6)
  a_NxK = hs.dense_activations(og, K)
  grad_lin = jax.grad(lambda p: cv.bank_loss(p, head, spec, LOSS, path="linear",
                                             terms="output"))(p0)
  expect = a_NxK.T @ np.asarray(og.g_NxD, np.float64) / mask.sum()
  np.testing.assert_allclose(grad_lin, expect, rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(og.act_Nxk)[~mask] == 0) and og.idx_Nxk.shape == (10, KA)


# straight_through-cosine: make test-long (issue 56 item 7).
@pytest.mark.parametrize("routing,distance", [
    pytest.param("straight_through", "cosine", marks=pytest.mark.long),
    ("plain", "sqeuclidean")])
def test_gauss_newton_blocks_equal_autodiff(model, routing, distance):
  model, batch = _fresh_bank(model, 5), _batch(5)
  with jax.enable_x64(True):
    head, spec = hs.head_and_spec(model, batch)
    spec = dataclasses.replace(spec, residual_routing=routing, distance=distance)
    ggn = hs.ggn_from_head(head, spec, LOSS)
    gn = hs.block_matrix(hs.gn_blocks_from_head(head, spec, LOSS))
    h = lambda **kw: hs.hessian_from_head(head, spec, LOSS, **kw)
    h_out = h(path="linear", terms="output", method="jax_hessian")
    h_clu = h(path="linear", terms="clustering", method="jax_hessian")
    clu = hs.block_matrix(hs.clustering_blocks_from_head(head, spec, LOSS))
    mu = np.asarray(cv.clustering_curvature(head, spec, LOSS))
    layer = cv.output_grads_and_head(head, spec, LOSS)[1].protos  # the cache's pass-1 route
    mu_layer = np.asarray(cv.clustering_curvature(head, spec, LOSS, layer=layer))
    h_full_hvp = h(path="full", method="hvp")
    h_full_ref = h(path="full", method="jax_hessian")
  assert np.linalg.norm(gn) > 0 and np.linalg.norm(clu) > 0
  assert _rel(gn, ggn) < 1e-5  # per-token Kronecker sum == autodiff J^T H J
  assert _rel(ggn, h_out) < 1e-5  # linear path: the GGN is the exact Hessian
  assert _rel(clu, h_clu) < 1e-5  # analytic clustering blocks == jax.hessian
  assert _rel(h_full_hvp, h_full_ref) < 1e-5
  blocks = hs.block_view(h_clu, K)
  np.testing.assert_allclose(mu, np.trace(blocks[np.arange(K), np.arange(K)], axis1=1,
                                          axis2=2) / D, rtol=1e-8, atol=1e-12)
  np.testing.assert_allclose(mu_layer, mu, rtol=1e-12, atol=1e-15)  # any distance
  off = blocks.copy()
  off[np.arange(K), np.arange(K)] = 0
  assert np.abs(off).max() == 0  # clustering curvature is local to each prototype
  if distance == "sqeuclidean":  # exactly mu_i I
    diag = blocks[np.arange(K), np.arange(K)]
    np.testing.assert_allclose(diag, mu[:, None, None] * np.eye(D), atol=1e-12)


def test_full_hessian_matches_library_loss_fp32(model):
  model, batch = _fresh_bank(model, 7), _batch(7)
  lib = hs.library_bank_loss(model, batch, LOSS)
  p0 = model.bank.protos[...]
  ref = jax.jit(jax.hessian(lambda v: lib(v.reshape(K, D))))(p0.reshape(-1))
  with jax.enable_x64(True):
    ours = hs.exact_hessian_wrt_bank(model, batch, LOSS, path="full")
  assert _rel(ours, ref) < 1e-5  # fp32 library vs our float64 head: same function (~1e-7)


def test_accumulator_streaming_equals_one_shot(model):
  model = _fresh_bank(model, 11)
  b1, b2 = _batch(1, 3, 6), _batch(2, 2, 6)
  acc = hs.CurvatureAccumulator(K, D, LOSS)
  og1, og2 = acc.update(model, b1), acc.update(model, b2)
  stats = acc.finalize()
  # One-shot float64 NumPy over the concatenated tokens.
  a_all = np.concatenate([hs.dense_activations(o, K) for o in (og1, og2)])
  g1, _, m1 = _np_G_t(model, b1)
  g2, _, m2 = _np_G_t(model, b2)
  mask = np.concatenate([m1, m2])
  n = mask.sum()
  np.testing.assert_allclose(stats.A, a_all.T @ a_all / n, rtol=1e-5, atol=1e-9)
  g_ref = np.concatenate([g1, g2])[mask].sum(0) / n
  np.testing.assert_allclose(stats.G, g_ref, rtol=1e-4, atol=1e-7 * np.abs(g_ref).max())
  spec = cv.check_model(model)
  mus = [np.asarray(cv.clustering_curvature(cv.head_inputs(model, b), spec, LOSS))
         for b in (b1, b2)]
  np.testing.assert_allclose(stats.mu, (mus[0] + mus[1]) / 2, rtol=1e-6)
  assert stats.count == n and stats.num_batches == 2
  acc.update(model, {**b1, "mask": np.zeros_like(b1["mask"])})  # all padding: no effect
  np.testing.assert_array_equal(acc.finalize().mu, stats.mu)
  # merge of per-batch accumulators, sparse storage, and a state round trip agree.
  parts = [hs.CurvatureAccumulator(K, D, LOSS, dense_max=1) for _ in range(2)]
  parts[0].update(model, b1)
  parts[1].update(model, b2)
  merged = hs.CurvatureAccumulator(K, D, LOSS, dense_max=1).load_state(
      parts[0].merge(parts[1]).state()).finalize()
  np.testing.assert_allclose(merged.a_dense(), stats.A, rtol=1e-12)
  np.testing.assert_allclose(merged.G, stats.G, rtol=1e-12)
  np.testing.assert_allclose(merged.mu, stats.mu, rtol=1e-12)
  emp = hs.CurvatureAccumulator(K, D, LOSS, fisher="empirical")
  emp.update(model, b1)
  g = np.asarray(og1.g_NxD, np.float64)
  np.testing.assert_allclose(emp.finalize().G, g.T @ g / m1.sum(), rtol=1e-5)


@pytest.mark.parametrize("distance", ["cosine", "sqeuclidean"])
def test_kfac_blocks_eig_and_conditioning_vs_numpy(model, distance):
  model, batch = _fresh_bank(model, 13), _batch(13, 3, 6)
  head, spec = cv.head_inputs(model, batch), cv.check_model(model)
  spec = dataclasses.replace(spec, distance=distance)
  st = hs.stats_from_head(head, spec, LOSS)
  assert st.mu.min() > 0
  blocks = hs.ggn_blocks(st)
  ref = np.kron(st.A, st.G) + np.kron(np.diag(st.mu), np.eye(D))
  np.testing.assert_allclose(hs.block_matrix(blocks.full), ref, rtol=1e-12, atol=1e-15)
  ad = np.diag(np.diag(st.A))
  np.testing.assert_allclose(hs.block_matrix(blocks.local),
                             np.kron(ad, st.G) + np.kron(np.diag(st.mu), np.eye(D)),
                             atol=1e-15)
  np.testing.assert_allclose(hs.block_matrix(blocks.coupling), np.kron(st.A - ad, st.G),
                             atol=1e-15)
  # Brute-force block norms, off-block share and condition numbers.
  norms = np.array([[np.linalg.norm(ref[i * D:(i + 1) * D, j * D:(j + 1) * D])
                     for j in range(K)] for i in range(K)])
  np.testing.assert_allclose(hs.kfac_block_norms(st), norms, rtol=1e-10)
  np.testing.assert_allclose(hs.block_norms(hs.block_view(ref, K)), norms, rtol=1e-12)
  share = (norms ** 2).sum() - (np.diag(norms) ** 2).sum()
  assert abs(hs.off_block_share(norms) - share / (norms ** 2).sum()) < 1e-12
  assert abs(hs.condition_number(ref) / np.linalg.cond(ref) - 1) < 1e-8
  lam = lambda m: np.linalg.eigvalsh(m)[-1]
  bound = (lam(st.A) * lam(st.G) + st.mu.max()) / st.mu.min()
  assert abs(hs.kappa_bound(st) - bound) < 1e-9 * bound
  assert hs.condition_number(ref) <= bound * (1 + 1e-9)
  evals, evecs = hs.eig_G(st, 3)
  full_vals = np.sort(np.linalg.eigvalsh(st.G))[::-1]
  np.testing.assert_allclose(evals, full_vals[:3], rtol=1e-10)
  np.testing.assert_allclose(st.G @ evecs, evecs * evals, atol=1e-10 * full_vals[0])
  assert hs.condition_number(np.diag([1.0, 0.0])) == float("inf")


def test_bad_inputs_are_named(model):
  batch = _batch(0)
  with pytest.raises(ValueError, match="missing 'mask'"):
    hs.output_grads(model, {k: batch[k] for k in ("inputs", "targets")}, LOSS)
  with pytest.raises(ValueError, match="path="):
    hs.exact_hessian_wrt_bank(model, batch, LOSS, path="diagonal")
  with pytest.raises(ValueError, match="kind='prism'"):
    cv.check_model(types.SimpleNamespace(cfg=ModelConfig(kind="dense")))
  with pytest.raises(ValueError, match="no valid tokens"):
    hs.CurvatureAccumulator(K, D, LOSS).finalize()
  with pytest.raises(ValueError, match="rank"):
    acc = hs.CurvatureAccumulator(K, D, LOSS)
    acc.update(model, batch)
    hs.eig_G(acc.finalize(), D + 1)
  with pytest.raises(ValueError, match="fisher"):
    hs.CurvatureAccumulator(K, D, LOSS, fisher="sampled")
  with pytest.raises(ValueError, match="bank shape"):
    hs.CurvatureAccumulator(K + 1, D, LOSS).update(model, batch)
  assert jnp.zeros(()).dtype == jnp.float32  # x64 contexts did not leak
