"""PrismLM / DenseLM: exact logit decomposition, gradient routing, causality, numerics."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax.config import ModelConfig
from prism_jax.losses import cross_entropy
from prism_jax.sharding import LOGICAL_RULES
from prism_jax.model import (DenseLM, PrismLM, build_model, decompose,
                             init_prototypes_from_hidden)

CFG = ModelConfig(vocab_size=97, max_len=16, d_model=32, n_layers=2, n_heads=2,
                  num_prototypes=37, k=4, implementation="xla")
B, T = 4, 12  # N = 48 >= K tokens, so prototype init fits in one batch
FWD = nnx.jit(lambda m, toks: m(toks))  # one compile per model config (eager is slower)


def tokens(seed, batch=B, seq=T, vocab=CFG.vocab_size):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


def with_data_bank(model, seed):
  """Prototypes on real hidden states (as in training), so sims are large and positive."""
  init_prototypes_from_hidden(model, tokens(seed), seed=seed)
  return model


@functools.partial(jax.jit, static_argnums=0)
def _ce_and_grads(graphdef, params, rest, toks, targets):
  def f(p):
    out = nnx.merge(graphdef, p, rest)(toks)
    mask_N = jnp.ones(toks.size, bool)
    loss = cross_entropy(out.logits_BxTxV.reshape(toks.size, -1), targets.reshape(-1), mask_N)
    return loss, out

  return jax.value_and_grad(f, has_aux=True)(params)


def ce_and_grads(model, toks, targets):
  """((CE loss, LMOutput), grads over nnx.Param); compiled once per model config."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return _ce_and_grads(graphdef, params, rest, toks, targets)


def test_decomposition_sums_to_the_logit_and_equals_the_dense_head():
  model = with_data_bank(build_model(CFG, seed=1), seed=2)
  toks = tokens(3)
  out = FWD(model, toks)
  n = B * T
  rng = np.random.default_rng(4)
  target_N = jnp.asarray(rng.integers(0, CFG.vocab_size, n), jnp.int32)
  dec = decompose(model, out.protos, target_N)
  assert dec.contrib_Nxk.shape == (n, CFG.k) and dec.contrib_Nxk.dtype == jnp.float32
  total = np.asarray(dec.contrib_Nxk, np.float64).sum(1) + np.asarray(dec.residual_N,
                                                                       np.float64)
  logits_NxV = np.asarray(out.logits_BxTxV).reshape(n, -1)
  model_logit = logits_NxV[np.arange(n), np.asarray(target_N)]
  # Relative to the typical logit size (a logit near 0 has no meaningful relative error).
  scale = np.abs(model_logit).mean()
  assert np.max(np.abs(total - model_logit)) <= 1e-5 * scale
  assert np.max(np.abs(np.asarray(dec.logit_N) - model_logit)) <= 1e-5 * scale
  # PRISM logits equal the dense head on z, and a float64 reference W z.
  dense = np.asarray(model.backbone.lm_head(out.z_BxTxD)).reshape(n, -1)
  np.testing.assert_allclose(logits_NxV, dense, rtol=0, atol=1e-5 * np.abs(dense).mean())
  w64 = np.asarray(model.backbone.wte[...], np.float64)
  z64 = np.asarray(out.z_BxTxD, np.float64).reshape(n, -1)
  np.testing.assert_allclose(logits_NxV, z64 @ w64.T, rtol=0, atol=1e-5 * np.abs(dense).mean())
  # Contributions match a float64 reference a_i <W_y, p_i> and the bank is really used.
  p64 = np.asarray(model.bank.protos[...], np.float64)[np.asarray(out.protos.idx_Nxk)]
  ref = np.asarray(out.protos.act_Nxk, np.float64) * np.einsum(
      "nkd,nd->nk", p64, w64[np.asarray(target_N)])
  np.testing.assert_allclose(np.asarray(dec.contrib_Nxk), ref, rtol=1e-5, atol=1e-7)
  assert np.mean(np.asarray(out.protos.act_Nxk) > 0) > 0.5
  # Signatures W p_i give the same contributions.
  sig_KxV = np.asarray(model.proto_logit_signatures())
  np.testing.assert_allclose(
      np.asarray(out.protos.act_Nxk) * sig_KxV[np.asarray(out.protos.idx_Nxk),
                                               np.asarray(target_N)[:, None]],
      np.asarray(dec.contrib_Nxk), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("routing", ["straight_through", "plain"])
def test_ce_gradient_reaches_the_bank_only_under_straight_through(routing):
  cfg = dataclasses.replace(CFG, residual_routing=routing)
  model = build_model(cfg, seed=5)
  _, grads = ce_and_grads(model, tokens(7), tokens(8))
  g_bank = np.asarray(grads["bank"]["protos"][...])
  g_wte = np.asarray(grads["backbone"]["wte"][...])
  assert np.abs(g_wte).sum() > 0  # the rest of the model trains either way
  if routing == "straight_through":
    assert np.count_nonzero(np.abs(g_bank).sum(1)) >= CFG.k
  else:
    assert np.all(g_bank == 0.0)


@pytest.mark.parametrize("kind", ["prism", "dense"])
def test_causality_by_gradient(kind):
  """d(output at t)/d(input embedding at s) is exactly zero for s > t, non-zero for s <= t.

  wpe row s is added to the embedding of position s only, so its gradient is the gradient
  w.r.t. that position's input (summed over the batch).
  """
  model = build_model(dataclasses.replace(CFG, kind=kind), seed=9)
  toks = tokens(11)
  proj = jnp.asarray(np.random.default_rng(12).normal(size=(B, T, CFG.vocab_size)),
                     jnp.float32)
  graphdef, wpe_state, rest = nnx.split(model, nnx.PathContains("wpe"), ...)

  def per_position(wpe):
    m = nnx.merge(graphdef, jax.tree.map(lambda _: wpe, wpe_state), rest)
    return jnp.sum(m(toks).logits_BxTxV * proj, axis=(0, 2))  # (T,)

  jac_TxPxD = np.asarray(jax.jit(jax.jacrev(per_position))(model.backbone.wpe[...]))
  mass_TxP = np.abs(jac_TxPxD).sum(-1)
  for t in range(T):
    assert np.all(mass_TxP[t, t + 1:] == 0.0), f"position {t} sees the future"
    assert np.all(mass_TxP[t, :t + 1] > 0), f"position {t} ignores its past"


def test_every_parameter_has_logical_axis_names():
  known = {name for name, _ in LOGICAL_RULES}
  for kind in ("prism", "dense"):
    model = build_model(dataclasses.replace(CFG, kind=kind))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(flat) > 10
    for path, var in flat:
      axes = var.get_metadata().get("out_sharding")
      assert axes is not None and len(axes) == var[...].ndim, (path, axes)
      assert all(a is None or a in known for a in axes), (path, axes)  # the one rules table
      assert var[...].dtype == jnp.float32
  prism = build_model(CFG)
  bank_axes = prism.bank.protos.get_metadata()["out_sharding"]
  model_axes = prism.backbone.wte.get_metadata()["out_sharding"]
  assert tuple(bank_axes) == ("proto", "embed") and tuple(model_axes) == ("vocab", "embed")
  mlp_axes = prism.backbone.blocks[0].mlp.fc_kernel.get_metadata()["out_sharding"]
  assert tuple(mlp_axes) == ("embed", "mlp")


def test_bf16_compute_keeps_fp32_params_and_is_close_to_fp32():
  toks, targets = tokens(13), tokens(14)
  results = {}
  for dtype in ("float32", "bfloat16"):
    model = build_model(dataclasses.replace(CFG, dtype=dtype), seed=15)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      assert var[...].dtype == jnp.float32
    (loss, out), grads = ce_and_grads(model, toks, targets)
    assert out.logits_BxTxV.dtype == jnp.float32 and out.z_BxTxD.dtype == jnp.float32
    results[dtype] = (out, loss, grads)
  (o32, l32, g32), (o16, l16, g16) = results["float32"], results["bfloat16"]
  assert abs(float(l16) - float(l32)) < 1e-2 * float(l32)
  z32, z16 = np.asarray(o32.z_BxTxD), np.asarray(o16.z_BxTxD)
  assert np.linalg.norm(z16 - z32) < 0.05 * np.linalg.norm(z32)
  assert not np.array_equal(z16, z32)  # bf16 really was used
  for name in ("wte", "wpe"):
    a, b = np.asarray(g32["backbone"][name][...]), np.asarray(g16["backbone"][name][...])
    assert b.dtype == np.float32
    assert np.linalg.norm(a - b) < 0.1 * np.linalg.norm(a), name


def test_remat_gives_the_same_loss_and_grads():
  toks, targets = tokens(17), tokens(18)
  results = []
  for remat in (False, True):
    model = build_model(dataclasses.replace(CFG, remat=remat), seed=19)
    (loss, _), grads = ce_and_grads(model, toks, targets)
    results.append((loss, grads))
  (l0, g0), (l1, g1) = results
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5,
                               atol=1e-6 * np.abs(np.asarray(a)).max())


@pytest.mark.parametrize("kmeans_pp", [True, False])
def test_init_prototypes_from_hidden(kmeans_pp):
  model = build_model(CFG, seed=21)
  toks = tokens(22)
  mask = np.random.default_rng(23).random((B, T)) < 0.9
  assert mask.sum() >= CFG.num_prototypes
  chosen = init_prototypes_from_hidden(model, toks, seed=24, mask_BxT=jnp.asarray(mask),
                                       kmeans_pp=kmeans_pp)
  assert len(chosen) == CFG.num_prototypes == len(set(chosen.tolist()))
  assert np.all(mask.reshape(-1)[chosen])
  z_NxD = np.asarray(model.backbone(toks)[0]).reshape(-1, CFG.d_model)
  np.testing.assert_allclose(np.asarray(model.bank.protos[...]), z_NxD[chosen], atol=1e-6)
  # Every chosen token is now covered by a prototype equal to it.
  out = FWD(model, toks)
  row_max = np.asarray(out.protos.row_max_cos_N)
  np.testing.assert_allclose(row_max[chosen], 1.0, atol=1e-5)
  few = np.zeros((B, T), bool)
  few.reshape(-1)[:30] = True
  with pytest.raises(ValueError, match="at least K=37 valid tokens, got 30"):
    init_prototypes_from_hidden(model, toks, mask_BxT=jnp.asarray(few))


@pytest.mark.parametrize("kind", ["prism", "dense"])
def test_kv_cache_forward_equals_uncached(kind):
  cfg = dataclasses.replace(CFG, kind=kind)
  model = build_model(cfg, seed=26)
  if kind == "prism":
    with_data_bank(model, seed=27)
  toks = tokens(28)
  full = FWD(model, toks)
  fwd = nnx.jit(lambda m, t, pos, c: m(t, pos, caches=c))
  caches = model.init_cache(B)
  pieces, pos = [], 0
  for chunk in (6, 1, 1, 1, 1, 1, 1):  # prefill, then decode steps
    positions = jnp.broadcast_to(jnp.arange(pos, pos + chunk), (B, chunk))
    out = fwd(model, toks[:, pos:pos + chunk], positions, caches)
    caches = out.caches
    pieces.append(out)
    pos += chunk
  assert pos == T
  z = np.concatenate([np.asarray(o.z_BxTxD) for o in pieces], axis=1)
  np.testing.assert_allclose(z, np.asarray(full.z_BxTxD), atol=2e-5)
  logits = np.concatenate([np.asarray(o.logits_BxTxV) for o in pieces], axis=1)
  np.testing.assert_allclose(logits, np.asarray(full.logits_BxTxV), atol=2e-5)
  # The raw backbone agrees too.
  z_bb, _ = model.backbone(toks[:, :4], jnp.broadcast_to(jnp.arange(4), (B, 4)),
                           model.backbone.init_cache(B))
  np.testing.assert_allclose(np.asarray(z_bb), np.asarray(full.z_BxTxD)[:, :4], atol=2e-5)


def test_dense_and_prism_share_the_backbone_and_reject_long_inputs():
  dense = build_model(dataclasses.replace(CFG, kind="dense"), seed=29)
  prism = build_model(CFG, seed=29)
  assert isinstance(dense, DenseLM) and isinstance(prism, PrismLM)
  toks = tokens(30)
  d_out, p_out = FWD(dense, toks), FWD(prism, toks)
  assert d_out.protos is None
  np.testing.assert_array_equal(np.asarray(d_out.z_BxTxD), np.asarray(p_out.z_BxTxD))
  np.testing.assert_allclose(np.asarray(d_out.logits_BxTxV), np.asarray(p_out.logits_BxTxV),
                             atol=1e-5 * np.abs(np.asarray(d_out.logits_BxTxV)).mean())
  with pytest.raises(ValueError, match="exceeds model.max_len=16"):
    dense(tokens(31, seq=17))
