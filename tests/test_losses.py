"""The four-term objective against float64 NumPy, with padding masks."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax import losses
from prism_jax.config import LossConfig, ModelConfig
from prism_jax.model import build_model
from prism_jax.model.prototypes import prototype_layer


def np_ce(logits, targets, mask):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(1, keepdims=True)
  logp = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
  nll = -logp[np.arange(len(targets)), targets]
  return nll[mask].mean()


def np_dist(z, p, distance):
  z, p = np.asarray(z, np.float64), np.asarray(p, np.float64)
  if distance == "cosine":
    cos = (z @ p.T) / np.outer(np.linalg.norm(z, axis=1), np.linalg.norm(p, axis=1))
    return 1.0 - cos
  return ((z[:, None] - p[None]) ** 2).sum(-1)


def masked_inputs(seed, n=40, d=12, num_protos=19):
  rng = np.random.default_rng(seed)
  z = (rng.normal(size=(n, d)) * rng.uniform(0.3, 3.0, size=(n, 1))).astype(np.float32)
  p = rng.normal(size=(num_protos, d)).astype(np.float32)
  mask = rng.random(n) < 0.7
  mask[:2] = (True, False)
  return z, p, mask


def test_cross_entropy_vs_float64():
  rng = np.random.default_rng(1)
  logits = (rng.normal(size=(30, 50)) * 4).astype(np.float32)
  targets = rng.integers(0, 50, 30)
  mask = rng.random(30) < 0.6
  got = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  np.testing.assert_allclose(float(got), np_ce(logits, targets, mask), rtol=1e-6)
  # Padding positions never matter, even with absurd logits there.
  logits2 = logits.copy()
  logits2[~mask] = 1e4 * rng.normal(size=logits2[~mask].shape)
  got2 = losses.cross_entropy(jnp.asarray(logits2), jnp.asarray(targets), jnp.asarray(mask))
  np.testing.assert_allclose(float(got2), float(got), rtol=1e-6)


@pytest.mark.parametrize("kind", ["relative", "plain"])
def test_reconstruction_vs_float64(kind):
  z, p, mask = masked_inputs(2)
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), 3, implementation="xla")
  got = losses.reconstruction(jnp.asarray(z), out.residual_NxD, jnp.asarray(mask), kind)
  z64 = z.astype(np.float64)
  cos = 1.0 - np_dist(z, p, "cosine")
  idx = np.argsort(-cos, axis=1, kind="stable")[:, :3]
  act = np.maximum(np.take_along_axis(cos, idx, 1), 0)
  r = z64 - np.einsum("nk,nkd->nd", act, p.astype(np.float64)[idx])
  per_tok = (r ** 2).sum(1)
  if kind == "relative":
    per_tok = per_tok / (z64 ** 2).sum(1)
  np.testing.assert_allclose(float(got), per_tok[mask].mean(), rtol=1e-5)
  with pytest.raises(ValueError, match="rec kind 'l1'"):
    losses.reconstruction(jnp.asarray(z), out.residual_NxD, jnp.asarray(mask), "l1")


@pytest.mark.parametrize("distance", ["cosine", "sqeuclidean"])
def test_r1_r2_vs_float64_with_padding(distance):
  z, p, mask = masked_inputs(3 if distance == "cosine" else 4)
  out = prototype_layer(jnp.asarray(z), jnp.asarray(p), 4, distance=distance,
                        mask_N=jnp.asarray(mask), implementation="xla")
  dist = np_dist(z, p, distance)
  r1_ref = dist[mask].min(0).mean()  # mean_i min_{valid t} dist(p_i, z_t)
  r2_ref = dist.min(1)[mask].mean()  # mean_{valid t} min_i dist(z_t, p_i)
  r1 = losses.r1_clustering(out.col_min_dist_K)
  r2 = losses.r2_clustering(out.row_min_dist_N, jnp.asarray(mask))
  tol = 1e-5 if distance == "cosine" else 1e-4
  np.testing.assert_allclose(float(r1), r1_ref, rtol=tol)
  np.testing.assert_allclose(float(r2), r2_ref, rtol=tol)
  # Differs from the unmasked value, so the mask is really applied.
  assert abs(dist.min(0).mean() - r1_ref) > 1e-3 or abs(dist.min(1).mean() - r2_ref) > 1e-3
  # An all-padding batch: R1 skips the +inf columns and R2 has nothing to average.
  empty = prototype_layer(jnp.asarray(z), jnp.asarray(p), 4, distance=distance,
                          mask_N=jnp.zeros(len(z), bool), implementation="xla")
  assert float(losses.r1_clustering(empty.col_min_dist_K)) == 0.0
  assert float(losses.r2_clustering(empty.row_min_dist_N, jnp.zeros(len(z), bool))) == 0.0


CFG = ModelConfig(vocab_size=61, max_len=8, d_model=16, n_layers=1, n_heads=2,
                  num_prototypes=13, k=3, implementation="xla")


@pytest.mark.parametrize("distance,rec_kind", [("cosine", "relative"), ("sqeuclidean", "plain")])
def test_total_loss_weighting_vs_float64(distance, rec_kind):
  model = build_model(dataclasses.replace(CFG, distance=distance), seed=5)
  rng = np.random.default_rng(6)
  toks = jnp.asarray(rng.integers(0, 61, (3, 8)), jnp.int32)
  targets = rng.integers(0, 61, (3, 8))
  mask = rng.random((3, 8)) < 0.75
  out = nnx.jit(lambda m_, t_, k_: m_(t_, mask_BxT=k_))(model, toks, jnp.asarray(mask))
  cfg = LossConfig(lambda_rec=0.3, lambda_r1=0.7, lambda_r2=1.9, rec_kind=rec_kind)
  loss, metrics = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg)
  # Independent float64 recomputation from the model's z, bank and logits.
  m = mask.reshape(-1)
  z = np.asarray(out.z_BxTxD, np.float64).reshape(24, -1)
  p = np.asarray(model.bank.protos[...], np.float64)
  ce = np_ce(np.asarray(out.logits_BxTxV).reshape(24, -1), targets.reshape(-1), m)
  cos = 1.0 - np_dist(z, p, "cosine")
  idx = np.argsort(-cos, axis=1, kind="stable")[:, :3]
  act = np.maximum(np.take_along_axis(cos, idx, 1), 0)
  if model.cfg.mixture == "normalized":
    act = act / np.maximum(act.sum(1, keepdims=True), 1e-6)
  r = z - np.einsum("nk,nkd->nd", act, p[idx])
  rec_tok = (r ** 2).sum(1) / ((z ** 2).sum(1) if rec_kind == "relative" else 1.0)
  dist = np_dist(z, p, distance)
  want = dict(ce=ce, rec=rec_tok[m].mean(), r1=dist[m].min(0).mean(),
              r2=dist.min(1)[m].mean(), residual_share=(r ** 2).sum(1)[m].mean() /
              (z ** 2).sum(1)[m].mean(), mean_active=(act > 0).sum(1)[m].mean())
  want["loss"] = ce + 0.3 * want["rec"] + 0.7 * want["r1"] + 1.9 * want["r2"]
  assert set(metrics) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(float(metrics[name]), value, rtol=2e-4, err_msg=name)
  assert float(loss) == float(metrics["loss"])


def test_dense_model_gets_cross_entropy_only():
  model = build_model(dataclasses.replace(CFG, kind="dense"), seed=7)
  rng = np.random.default_rng(8)
  toks = jnp.asarray(rng.integers(0, 61, (2, 8)), jnp.int32)
  targets = rng.integers(0, 61, (2, 8))
  mask = rng.random((2, 8)) < 0.8
  out = nnx.jit(lambda m_, t_: m_(t_))(model, toks)
  loss, metrics = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask),
                                    LossConfig(lambda_rec=1.0, lambda_r1=1.0, lambda_r2=1.0))
  assert set(metrics) == {"ce", "loss"}
  want = np_ce(np.asarray(out.logits_BxTxV).reshape(16, -1), targets.reshape(-1),
               mask.reshape(-1))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(metrics["ce"]) == float(loss)
