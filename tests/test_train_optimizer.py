"""Optimiser: weight-decay mask, schedule and one AdamW update against a NumPy reference."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from prism_jax.config import TrainConfig, model_preset
from prism_jax.model.lm import build_model
from prism_jax.train import optimizer as opt_lib


@functools.cache
def _params(seed=0):
  cfg = model_preset("tiny", d_model=16, n_layers=2, n_heads=2, num_prototypes=8, k=2,
                     vocab_size=64, max_len=16)
  make = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg, seed), nnx.Param)))
  return make()


def _flat(tree):
  return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_decay_mask_names():
  mask = _flat(opt_lib.decay_mask(_params()))
  no_decay = {k for k, v in mask.items() if not v}
  decay = {k for k, v in mask.items() if v}
  assert "['bank']['protos']" in no_decay
  for k in mask:
    is_norm = "['ln" in k and (k.endswith("['scale']") or k.endswith("['bias']"))
    is_bias = k.endswith("_bias']") or k.endswith("['bias']")
    if is_norm or is_bias or "protos" in k:
      assert k in no_decay, k
    else:
      assert k in decay, k
  # the matmul weights and (tied) embeddings decay
  assert "['backbone']['wte']" in decay and "['backbone']['wpe']" in decay
  assert any(k.endswith("['qkv_kernel']") for k in decay)
  assert any(k.endswith("['qkv_bias']") for k in no_decay)


def test_adamw_update_matches_numpy_reference():
  """One update from fresh moments with random grads: decayed leaves shrink by lr*wd*p,
  masked leaves (protos, norms, biases) do not; clipping by global norm first."""
  cfg = TrainConfig(lr=0.1, warmup_steps=0, steps=10, weight_decay=0.3, grad_clip=0.5,
                    b1=0.9, b2=0.95)
  params = _params(1)
  rng = np.random.default_rng(7)
  grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
  tx = opt_lib.make_optimizer(cfg)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  new = jax.tree.map(lambda p, u: p + u, params, updates)

  g64 = {k: np.asarray(v, np.float64) for k, v in _flat(grads).items()}
  norm = np.sqrt(sum(np.sum(g * g) for g in g64.values()))
  scale = min(1.0, cfg.grad_clip / norm)
  lr = float(opt_lib.lr_schedule(cfg)(0))
  np.testing.assert_allclose(lr, 0.1, rtol=1e-6)
  mask = _flat(opt_lib.decay_mask(params))
  for key, p in _flat(params).items():
    p = np.asarray(p, np.float64)
    g = g64[key] * scale
    m_hat, v_hat = g, g * g  # first step: bias-corrected moments equal g, g^2
    upd = m_hat / (np.sqrt(v_hat) + 1e-8)
    if mask[key]:
      upd = upd + cfg.weight_decay * p
    want = p - lr * upd
    np.testing.assert_allclose(np.asarray(_flat(new)[key], np.float64), want,
                               rtol=2e-5, atol=2e-6, err_msg=key)


def test_schedule_warmup_then_cosine_to_floor():
  cfg = TrainConfig(lr=2e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1)
  sched = opt_lib.lr_schedule(cfg)
  steps = np.arange(0, 111)
  got = np.asarray([float(sched(s)) for s in steps])
  want = np.where(steps < 10, 2e-3 * steps / 10,
                  2e-4 + 0.5 * (2e-3 - 2e-4) * (1 + np.cos(np.pi * (steps - 10) / 100)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_reset_moments_zeroes_only_the_bank():
  params = _params(2)
  tx = opt_lib.make_optimizer(TrainConfig(warmup_steps=0))
  rng = np.random.default_rng(3)
  grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  reset = opt_lib.reset_moments(state)
  before, after = _flat(state), _flat(reset)
  touched = [k for k in before if not np.array_equal(before[k], after[k])]
  assert touched and all(k.endswith("['bank']['protos']") for k in touched)
  assert all(not np.any(after[k]) for k in touched)
  assert len(touched) == 2  # Adam mu and nu


@pytest.mark.parametrize("bad", [dict(lr=0.0), dict(warmup_steps=-1)])
def test_bad_train_config_is_rejected(bad):
  with pytest.raises(ValueError):
    dataclasses.replace(TrainConfig(), **bad)
