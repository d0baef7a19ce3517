"""model.bias and model.dropout: parameter shapes and counts, determinism, off at eval."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prism_jax import flops
from prism_jax.config import Config, DataConfig, ModelConfig, TrainConfig
from prism_jax.model import build_model
from prism_jax.model.ops import dropout
from prism_jax.train import step as step_lib

CFG = ModelConfig(vocab_size=64, max_len=16, d_model=32, n_layers=2, n_heads=4,
                  num_prototypes=16, k=4)


def _param_paths(model):
  return ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize("kind", ["prism", "dense"])
def test_bias_false_has_no_biases_and_counts_match(kind):
  for bias in (True, False):
    cfg = dataclasses.replace(CFG, kind=kind, bias=bias)
    model = build_model(cfg, seed=1)
    paths = _param_paths(model)
    assert any("bias" in p for p in paths) == bias
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == flops.param_counts(cfg)["prism" if kind == "prism" else "dense"]
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, cfg.vocab_size)
    assert model(tokens).logits_BxTxV.shape == (2, 8, cfg.vocab_size)
  # Unbiased GPT-2 per layer: 4D² + 2DF + 2D (LayerNorm scales), D for ln_f.
  d, f = CFG.d_model, CFG.d_mlp
  unbiased = flops.param_counts(dataclasses.replace(CFG, bias=False))["dense"]
  assert unbiased == (CFG.vocab_size + CFG.max_len) * d + CFG.n_layers * (
      4 * d * d + 2 * d * f + 2 * d) + d


def test_dropout_helper_rate_and_scale():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(200, 500)) + 3.0, jnp.float32)
  y = np.asarray(dropout(x, 0.25, jax.random.key(5)))
  dropped = y == 0.0
  assert abs(dropped.mean() - 0.25) < 0.01
  np.testing.assert_allclose(y[~dropped], np.asarray(x)[~dropped] / 0.75, rtol=1e-6)
  assert dropout(x, 0.25, None) is x and dropout(x, 0.0, jax.random.key(5)) is x


@pytest.mark.parametrize("kind", ["prism", "dense"])
def test_dropout_is_off_at_eval_and_deterministic_in_the_key(kind):
  cfg = dataclasses.replace(CFG, kind=kind, dropout=0.3)
  model = build_model(cfg, seed=3)
  plain = build_model(dataclasses.replace(cfg, dropout=0.0), seed=3)  # same parameters
  tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, cfg.vocab_size)
  off = model(tokens).logits_BxTxV
  np.testing.assert_array_equal(off, plain(tokens).logits_BxTxV)  # no key: no dropout
  a = model(tokens, dropout_key=jax.random.key(7)).logits_BxTxV
  b = model(tokens, dropout_key=jax.random.key(7)).logits_BxTxV
  c = model(tokens, dropout_key=jax.random.key(8)).logits_BxTxV
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, off) and not np.allclose(a, c)


def test_train_loss_draws_masks_from_the_step():
  data = DataConfig(seq_len=8)
  cfg = Config(model=dataclasses.replace(CFG, dropout=0.2), data=data, train=TrainConfig(seed=11))
  model = build_model(cfg.model, seed=0)
  rng = np.random.default_rng(6)
  toks = rng.integers(0, CFG.vocab_size, (2, 9))
  batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
           "mask": jnp.ones((2, 8), bool)}
  loss = lambda s: float(step_lib._model_loss(model, batch, cfg, jnp.int32(s))[0])  # pylint: disable=protected-access
  assert loss(3) == loss(3) and loss(3) != loss(4)
  no_dropout = Config(model=CFG, data=data, train=TrainConfig(seed=11))
  assert float(step_lib._model_loss(model, batch, no_dropout, jnp.int32(3))[0]) == float(  # pylint: disable=protected-access
      step_lib._model_loss(model, batch, no_dropout, None)[0])  # pylint: disable=protected-access
