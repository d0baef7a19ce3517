"""A user's own backbone under the PRISM head (prism_jax.model.register_backbone): the
config accepts the registered name only, the model built from it carries the user's module,
and its logits and decomposition are the head's on the user's z and W (float64 NumPy)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from prism_jax.config import ModelConfig
from prism_jax.model import HiddenStateBackbone, build_model, decompose, register_backbone
from prism_jax.model.params import normal_param


class _Bag(HiddenStateBackbone):
  """z_t = tanh(mean of the embeddings of tokens 0..t @ M): causal, not a transformer."""

  def __init__(self, cfg, *, rngs):
    self.cfg = cfg
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.d_model), 0.5, ("vocab", "embed"))
    self.mix = normal_param(rngs, (cfg.d_model, cfg.d_model), 0.5, ("embed", None))

  def __call__(self, tokens_BxT, positions_BxT=None, caches=None, tap=None, dropout_key=None):
    e = self.embed[...][tokens_BxT]
    mean = jnp.cumsum(e, 1) / jnp.arange(1, e.shape[1] + 1)[None, :, None]
    return jnp.tanh(mean @ self.mix[...]).astype(jnp.float32), caches

  def unembedding(self):
    return self.embed[...]


def test_an_unregistered_name_is_one_clear_error():
  with pytest.raises(ValueError, match="model.arch='nobody' is not one of .* nor a registered"):
    ModelConfig(arch="nobody")


def test_a_registered_backbone_carries_the_head():
  register_backbone("bag_test", _Bag)
  with pytest.raises(ValueError, match="built in"):
    register_backbone("llama", _Bag)
  cfg = ModelConfig(arch="bag_test", vocab_size=40, d_model=16, n_heads=2, num_prototypes=24,
                    k=3, max_len=12)
  model = build_model(cfg, seed=int(np.random.default_rng().integers(1000)))
  assert isinstance(model.backbone, _Bag)
  ids = jnp.asarray(np.random.default_rng().integers(0, 40, (2, 12)), jnp.int32)
  out = model(ids)
  z = np.asarray(out.z_BxTxD, np.float64).reshape(-1, 16)
  w = np.asarray(model.backbone.unembedding(), np.float64)
  np.testing.assert_allclose(np.asarray(out.logits_BxTxV).reshape(-1, 40), z @ w.T,
                             rtol=1e-5, atol=1e-5)  # W r + W z_hat = W z
  target = jnp.asarray(np.random.default_rng().integers(0, 40, 24))
  dec = decompose(model, out.protos, target)
  np.testing.assert_allclose(np.asarray(dec.contrib_Nxk).sum(-1) + np.asarray(dec.residual_N),
                             (z @ w.T)[np.arange(24), np.asarray(target)], rtol=1e-5, atol=1e-5)
  dense = build_model(dataclasses.replace(cfg, kind="dense"))
  assert isinstance(dense.backbone, _Bag) and dense(ids).protos is None
