"""Streaming grounding metrics against a brute-force float64 pass over all batches."""

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax import grounding
from prism_jax.grounding import (GroundingAccumulator, grounding_finalize,
                                 grounding_init, grounding_merge, grounding_update)
from prism_jax.config import ModelConfig
from prism_jax.model import build_model
from prism_jax.model.prototypes import prototype_layer


def make_data(seed, num_protos, d, num_batches, n, signed):
  """Random bank and token batches with padding masks.

  `signed`: half the bank points away from every token (cos < 0), so those prototypes can
  enter a top-k with activation 0 and must count as dead.
  """
  rng = np.random.default_rng(seed)
  if signed:
    u = rng.normal(size=d)
    u /= np.linalg.norm(u)
    half = num_protos // 2
    p = np.concatenate([2 * u + 0.3 * rng.normal(size=(half, d)),
                        -2 * u + 0.3 * rng.normal(size=(num_protos - half, d))])
    zs = [2 * u + 0.5 * rng.normal(size=(n, d)) for _ in range(num_batches)]
  else:
    p = rng.normal(size=(num_protos, d))
    zs = [rng.normal(size=(n, d)) * rng.uniform(0.5, 2, size=(n, 1))
          for _ in range(num_batches)]
  masks = [rng.random(n) < 0.7 for _ in range(num_batches)]
  masks[-1][:] = False  # an all-padding batch changes nothing
  return p.astype(np.float32), [z.astype(np.float32) for z in zs], masks


def brute_force(p, zs, masks, k, mixture):
  p = p.astype(np.float64)
  z = np.concatenate([z for z, m in zip(zs, masks)]).astype(np.float64)
  valid = np.concatenate(masks)
  z = z[valid]
  cos = (z @ p.T) / np.outer(np.linalg.norm(z, axis=1), np.linalg.norm(p, axis=1))
  order = np.argsort(-cos, axis=1, kind="stable")
  srt = np.take_along_axis(cos, order, 1)
  gap = srt[:, k - 1] - srt[:, k] if k < p.shape[0] else np.inf
  assert np.min(gap) > 1e-5, "construction must be tie-free at the top-k boundary"
  idx = order[:, :k]
  act = np.maximum(np.take_along_axis(cos, idx, 1), 0)
  usage = np.bincount(idx[act > 0], minlength=p.shape[0])
  if mixture == "normalized":
    act = act / np.maximum(act.sum(1, keepdims=True), 1e-6)
  r = z - np.einsum("nk,nkd->nd", act, p[idx])
  return {"r1_bar": cos.max(0).mean(), "r2_bar": cos.max(1).mean(),
          "residual_share": (r ** 2).sum() / (z ** 2).sum(), "usage": usage,
          "dead": int(np.sum(usage == 0)), "num_tokens": len(z)}


@pytest.mark.parametrize("num_protos,k,mixture,signed", [
    (29, 3, "raw", False), (12, 8, "normalized", True), (40, 1, "raw", True)])
def test_streaming_metrics_match_brute_force(num_protos, k, mixture, signed):
  p, zs, masks = make_data(num_protos + k, num_protos, 10, 5, 24, signed)
  state = grounding_init(num_protos)
  update = jax.jit(grounding_update)
  states = []
  for z, m in zip(zs, masks):
    out = prototype_layer(jnp.asarray(z), jnp.asarray(p), k, mixture=mixture,
                          mask_N=jnp.asarray(m), implementation="xla")
    state = update(state, out, jnp.asarray(z), jnp.asarray(m))
    states.append(update(grounding_init(num_protos), out, jnp.asarray(z), jnp.asarray(m)))
  got = grounding_finalize(state)
  want = brute_force(p, zs, masks, k, mixture)
  for name in ("r1_bar", "r2_bar", "residual_share"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    assert isinstance(got[name], float)
  np.testing.assert_array_equal(got["usage"], want["usage"])
  assert got["dead"] == want["dead"] and got["num_tokens"] == want["num_tokens"]
  assert got["dead_frac"] == want["dead"] / num_protos
  if signed:  # the bank's far half sits in top-k lists with a = 0 but is never active
    assert want["dead"] >= num_protos // 2 and 0 < want["usage"].sum()
  # Per-batch states merge (in any grouping) to the streamed state.
  left = states[0]
  for s in states[1:3]:
    left = grounding_merge(left, s)
  right = grounding_merge(states[4], states[3])
  merged = grounding_finalize(grounding_merge(right, left))
  for name in ("r1_bar", "r2_bar", "residual_share"):
    np.testing.assert_allclose(merged[name], got[name], rtol=1e-6)
  np.testing.assert_array_equal(merged["usage"], got["usage"])


def test_accumulator_on_a_prism_model_and_errors():
  cfg = ModelConfig(vocab_size=50, max_len=8, d_model=16, n_layers=1, n_heads=2,
                    num_prototypes=11, k=2, implementation="xla")
  model = build_model(cfg, seed=1)
  rng = np.random.default_rng(2)
  acc = GroundingAccumulator(11)
  zs, masks = [], []
  fwd = nnx.jit(lambda m_, t_, k_: m_(t_, mask_BxT=k_))
  for _ in range(3):
    toks = jnp.asarray(rng.integers(0, 50, (2, 8)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 8)) < 0.8)
    out = fwd(model, toks, mask)
    acc.update_from_output(out, mask)
    zs.append(np.asarray(out.z_BxTxD).reshape(16, -1))
    masks.append(np.asarray(mask).reshape(-1))
  want = brute_force(np.asarray(model.bank.protos[...]), zs, masks, 2, cfg.mixture)
  got = acc.result()
  for name in ("r1_bar", "r2_bar", "residual_share"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
  np.testing.assert_array_equal(got["usage"], want["usage"])
  empty = grounding_finalize(grounding_init(11))
  assert np.isnan(empty["r1_bar"]) and np.isnan(empty["r2_bar"]) and empty["dead"] == 11
  dense = build_model(dataclasses.replace(cfg, kind="dense"))
  with pytest.raises(ValueError, match="need a PrismLM output"):
    acc.update_from_output(dense(toks))
  with pytest.raises(ValueError, match="state tracks K=7 prototypes but the batch has 11"):
    grounding_update(grounding_init(7), out.protos, out.z_BxTxD.reshape(16, -1))
  with pytest.raises(ValueError, match="num_prototypes must be a positive int"):
    grounding_init(0)


def test_common_direction_cosine_and_the_collapse_warning():
  """The shared-direction diagnostic the bank's init reports (train/recipe.py): the mean
  cosine of states to their mean direction, against a float64 loop by hand; spread states
  pass silently, states near one direction get the one-line warning."""
  rng = np.random.default_rng(secrets.randbits(32))
  spread = rng.normal(size=(300, 24))
  e = rng.normal(size=24)
  shared = 20.0 * e / np.linalg.norm(e) + rng.normal(size=(300, 24))
  for z in (spread, shared):
    units = [row / np.sqrt(sum(v * v for v in row)) for row in z]
    mean = sum(units) / len(units)
    mean = mean / np.sqrt(sum(v * v for v in mean))
    want = sum(float(np.dot(u, mean)) for u in units) / len(units)
    assert grounding.common_direction_cos(z.astype(np.float32)) == pytest.approx(want,
                                                                                 abs=1e-6)
  assert grounding.shared_direction_warning(grounding.common_direction_cos(spread)) == ""
  warning = grounding.shared_direction_warning(grounding.common_direction_cos(shared))
  assert "share one direction" in warning and "train.proto_init_step" in warning
  assert "\n" not in warning
