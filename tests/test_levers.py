"""Issue 11's faithfulness levers: learned mixture scale, residual dropout, λ_proto, λ_rec ramp,
λ_rlogit, λ_proto_kl."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax import losses
from prism_jax.config import Config, DataConfig, LossConfig, ModelConfig, TrainConfig
from prism_jax.model import build_model, decompose, init_prototypes_from_hidden
from prism_jax.train.optimizer import decays
from prism_jax.train.step import _residual_keep

CFG = ModelConfig(vocab_size=43, max_len=10, d_model=16, n_layers=1, n_heads=2,
                  num_prototypes=23, k=3, implementation="xla")
B, T = 3, 10


def setup(seed, **model_overrides):
  model = build_model(dataclasses.replace(CFG, **model_overrides), seed=seed)
  rng = np.random.default_rng(seed + 100)
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
  init_prototypes_from_hidden(model, toks, seed=seed)
  return model, toks, rng


def loss_inputs(seed):
  """A fresh model, its tokens, random targets, a random mask and the model's output."""
  model, toks, rng = setup(seed)
  targets = rng.integers(0, CFG.vocab_size, (B, T))
  mask = rng.random((B, T)) < 0.8
  return model, toks, targets, mask, model(toks, mask_BxT=jnp.asarray(mask))


def np_head(model, toks, scale=1.0):
  """Float64 z, z_hat (normalised mixture times `scale`) and W."""
  z, _ = model.backbone(toks)
  z = np.asarray(z, np.float64).reshape(B * T, -1)
  p = np.asarray(model.bank.protos[...], np.float64)
  cos = (z @ p.T) / np.outer(np.linalg.norm(z, axis=1), np.linalg.norm(p, axis=1))
  idx = np.argsort(-cos, axis=1, kind="stable")[:, :CFG.k]
  act = np.maximum(np.take_along_axis(cos, idx, 1), 0.0)
  act /= np.maximum(act.sum(1, keepdims=True), 1e-6)
  return z, scale * np.einsum("nk,nkd->nd", act, p[idx]), np.asarray(model.backbone.wte[...],
                                                                     np.float64)


def test_learned_mixture_scale_keeps_the_decomposition_exact():
  model, toks, rng = setup(1, mixture_scale="learned")
  model.mix_log_scale[...] = jnp.asarray(np.log(1.7), jnp.float32)  # away from s = 1
  assert float(model.mixture_scale()) == pytest.approx(1.7)
  out = nnx.jit(lambda m, t: m(t))(model, toks)
  z, z_hat, w = np_head(model, toks, scale=1.7)
  np.testing.assert_allclose(out.protos.z_hat_NxD, z_hat, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out.protos.residual_NxD, z - z_hat, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out.logits_BxTxV.reshape(B * T, -1), z @ w.T, rtol=1e-4, atol=1e-4)
  target = jnp.asarray(rng.integers(0, CFG.vocab_size, B * T), jnp.int32)
  dec = decompose(model, out.protos, target)
  np.testing.assert_allclose(dec.contrib_Nxk.sum(1) + dec.residual_N, dec.logit_N, rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(dec.logit_N, (z @ w.T)[np.arange(B * T), target], rtol=1e-4,
                             atol=1e-4)


def test_mixture_scale_learns_from_the_prototype_path_and_is_not_decayed():
  model, toks, rng = setup(2, mixture_scale="learned")
  targets = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def proto_ce(p):
    m = nnx.merge(graphdef, p, rest)
    out = m(toks)
    logits = m.proto_path_logits(out.protos, B, T)
    return losses.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1),
                                jnp.ones(B * T, bool))

  grads = jax.grad(proto_ce)(params)
  assert abs(float(grads["mix_log_scale"][...])) > 1e-6
  assert not decays((jax.tree_util.DictKey("mix_log_scale"),))


def test_residual_dropout_gives_the_prototype_logits_where_dropped():
  model, toks, rng = setup(3)
  keep = rng.random((B, T)) < 0.5
  out = nnx.jit(lambda m, t, k: m(t, residual_keep_BxT=k))(model, toks, jnp.asarray(keep))
  z, z_hat, w = np_head(model, toks)
  want = np.where(keep.reshape(-1, 1), z, z_hat) @ w.T
  np.testing.assert_allclose(out.logits_BxTxV.reshape(B * T, -1), want, rtol=1e-4, atol=1e-4)
  # The decomposition returned keeps the true residual (REC and metrics see r_t).
  np.testing.assert_allclose(out.protos.residual_NxD, z - z_hat, rtol=1e-4, atol=1e-5)


def test_residual_dropout_mask_is_deterministic_from_the_step():
  cfg = Config(model=dataclasses.replace(CFG, residual_dropout=0.3),
               data=DataConfig(seq_len=T), train=TrainConfig(seed=4))
  a = np.asarray(_residual_keep(cfg, jnp.asarray(5), (64, 64)))
  np.testing.assert_array_equal(a, np.asarray(_residual_keep(cfg, jnp.asarray(5), (64, 64))))
  assert not np.array_equal(a, np.asarray(_residual_keep(cfg, jnp.asarray(6), (64, 64))))
  assert abs(1.0 - a.mean() - 0.3) < 0.03  # ~4096 Bernoulli draws: 3 sigma is 0.021
  assert _residual_keep(Config(model=CFG, data=DataConfig(seq_len=T)), jnp.asarray(5),
                        (4, 4)) is None


def test_lambda_proto_and_rec_ramp_vs_float64():
  model, toks, targets, mask, out = loss_inputs(5)
  proto_logits = model.proto_path_logits(out.protos, B, T)
  base = LossConfig(lambda_rec=0.4, lambda_r1=0.2, lambda_r2=0.6)
  cfg = dataclasses.replace(base, lambda_proto=0.7, rec_ramp_steps=40)
  _, ref = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), base)
  loss, metrics = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg,
                                    step=10, proto_logits_BxTxV=proto_logits)
  z, z_hat, w = np_head(model, toks)
  logits, m, y = z_hat @ w.T, mask.reshape(-1), targets.reshape(-1)
  lse = logits.max(1) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
  proto_ce = (lse - logits[np.arange(B * T), y])[m].mean()
  np.testing.assert_allclose(float(metrics["proto_ce"]), proto_ce, rtol=1e-5)
  # λ_rec at step 10 of a 40-step ramp is a quarter of 0.4.
  want = (float(ref["ce"]) + 0.1 * float(ref["rec"]) + 0.2 * float(ref["r1"])
          + 0.6 * float(ref["r2"]) + 0.7 * proto_ce)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert losses.rec_weight(cfg, 80) == pytest.approx(0.4)
  assert losses.rec_weight(cfg, None) == 0.4 and losses.rec_weight(base, 3) == 0.4
  with pytest.raises(ValueError, match="loss.lambda_proto > 0 needs proto_logits_BxTxV"):
    losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg)


def test_lambda_rlogit_vs_float64():
  model, toks, targets, mask, out = loss_inputs(6)
  proto_logits = model.proto_path_logits(out.protos, B, T)
  base = LossConfig(lambda_rec=0.4, lambda_r1=0.2, lambda_r2=0.6)
  cfg = dataclasses.replace(base, lambda_rlogit=0.9)
  assert cfg.needs_proto_logits and not base.needs_proto_logits
  _, ref = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), base)
  loss, metrics = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg,
                                    proto_logits_BxTxV=proto_logits)
  z, z_hat, w = np_head(model, toks)
  m = mask.reshape(-1)
  # The residual's share of each token's logit variance over the vocabulary, W r = W(z - z_hat).
  ratio_N = ((z - z_hat) @ w.T).var(axis=1) / (z @ w.T).var(axis=1)
  assert 0.01 < ratio_N[m].mean() < 10.0  # a fresh model: neither term negligible
  np.testing.assert_allclose(float(metrics["rlogit"]), ratio_N[m].mean(), rtol=1e-4)
  want = float(ref["loss"]) + 0.9 * ratio_N[m].mean()
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert "proto_ce" not in metrics  # λ_proto stays off
  with pytest.raises(ValueError, match="loss.lambda_rlogit > 0 needs proto_logits_BxTxV"):
    losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg)


def test_lambda_proto_kl_vs_float64_and_teacher_not_moved():
  model, toks, targets, mask, out = loss_inputs(8)
  # A fresh model's logits are nearly flat (KL ~1e-4): scaled up, as a trained model's are.
  scale = 40.0
  out = out._replace(logits_BxTxV=scale * out.logits_BxTxV)
  proto_logits = scale * model.proto_path_logits(out.protos, B, T)
  base = LossConfig(lambda_rec=0.4, lambda_r1=0.2, lambda_r2=0.6)
  cfg = dataclasses.replace(base, lambda_proto_kl=1.3)
  _, ref = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), base)
  loss, metrics = losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg,
                                    proto_logits_BxTxV=proto_logits)
  z, z_hat, w = np_head(model, toks)
  log_softmax = lambda x: x - x.max(1, keepdims=True) - np.log(
      np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
  logp, logq = log_softmax(scale * z @ w.T), log_softmax(scale * z_hat @ w.T)
  m = mask.reshape(-1)
  kl_N = (np.exp(logp) * (logp - logq)).sum(1)
  assert kl_N[m].mean() > 0.05
  np.testing.assert_allclose(float(metrics["proto_kl"]), kl_N[m].mean(), rtol=1e-4)
  np.testing.assert_allclose(float(loss), float(ref["loss"]) + 1.3 * kl_N[m].mean(), rtol=1e-5)
  # The model's distribution is the teacher: no gradient reaches the full logits.
  logits_NxV = out.logits_BxTxV.reshape(B * T, -1)
  proto_NxV = proto_logits.reshape(B * T, -1)
  g_full, g_proto = jax.grad(losses.proto_kl, argnums=(0, 1))(logits_NxV, proto_NxV,
                                                              jnp.asarray(m))
  assert float(jnp.abs(g_full).max()) == 0.0 and float(jnp.abs(g_proto).max()) > 1e-4
  with pytest.raises(ValueError, match="loss.lambda_proto_kl > 0 needs proto_logits_BxTxV"):
    losses.total_loss(out, jnp.asarray(targets), jnp.asarray(mask), cfg)


def test_rlogit_ignores_a_shift_common_to_all_logits():
  rng = np.random.default_rng(7)
  logits_NxV = jnp.asarray(rng.normal(size=(6, 11)), jnp.float32)
  proto_NxV = jnp.asarray(rng.normal(size=(6, 11)), jnp.float32)
  shift_Nx1 = jnp.asarray(rng.normal(size=(6, 1)) * 5, jnp.float32)
  mask_N = jnp.ones(6, bool)
  a = losses.residual_logit_share(logits_NxV, proto_NxV, mask_N)
  b = losses.residual_logit_share(logits_NxV, proto_NxV - shift_Nx1, mask_N)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  assert float(losses.residual_logit_share(logits_NxV, logits_NxV + shift_Nx1, mask_N)) < 1e-6


@pytest.mark.parametrize("cls,overrides,match", [
    (ModelConfig, dict(residual_dropout=1.0), r"model.residual_dropout must be in \[0, 1\)"),
    (ModelConfig, dict(residual_dropout=-0.1), r"model.residual_dropout must be in \[0, 1\)"),
    (ModelConfig, dict(mixture_scale="per_token"), "model.mixture_scale='per_token'"),
    (LossConfig, dict(lambda_proto=-1.0), "loss.lambda_proto must be >= 0"),
    (LossConfig, dict(lambda_rlogit=-0.5), "loss.lambda_rlogit must be >= 0"),
    (LossConfig, dict(lambda_proto_kl=-2.0), "loss.lambda_proto_kl must be >= 0"),
    (LossConfig, dict(rec_ramp_steps=-5), "loss.rec_ramp_steps must be an int >= 0"),
    (LossConfig, dict(rec_ramp_steps=2.5), "loss.rec_ramp_steps must be an int >= 0"),
])
def test_bad_lever_values_are_named(cls, overrides, match):
  with pytest.raises(ValueError, match=match):
    cls(**overrides)
